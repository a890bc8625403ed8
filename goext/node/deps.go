package node

import (
	"log/slog"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/worker"
)

// Deps are what the assembly takes from its caller instead of reaching for
// it: every field may be left zero.
type Deps struct {
	// Registry is where components of one process meet; nil: Process().
	Registry *Registry
	// Logger; nil: slog.Default().
	Logger *slog.Logger
	// Now is the leader's clock; nil: time.Now.
	Now func() time.Time
	// NewCopier returns the G1 copier for the engine's tensors, or nil
	// when they are host memory (the plain host copies); nil: host memory
	// always. The CUDA build of the C ABI passes the CUDA copier.
	NewCopier func(eng *layout.Engine, cfg *config.Config) (worker.G1Copier, error)
	// TuneStore completes the options of every G4 store opened; nil:
	// DefaultStoreTuner.
	TuneStore StoreTuner
}

func (d Deps) registry() *Registry {
	if d.Registry == nil {
		return Process()
	}
	return d.Registry
}

func (d Deps) logger() *slog.Logger {
	if d.Logger == nil {
		return slog.Default()
	}
	return d.Logger
}
