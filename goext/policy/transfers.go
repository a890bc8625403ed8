package policy

import (
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/plan"
)

// The workers of a process report their timed transfer batches here
// (ReportTransfer); a leader in the same process feeds them to its Model
// (SubscribeTransfers). Ranks in other processes are not heard: their
// leader's model keeps its priors for the tiers they alone load.
var hub struct {
	mu   sync.RWMutex
	next int
	subs map[int]func(dir string, bytes int64, d time.Duration)
}

// ReportTransfer announces one timed batch of direction dir (the worker's
// names: "g2_to_g1", "g3_to_g1", "g4_to_g2", ...) that moved bytes (one
// rank's share) in d.
func ReportTransfer(dir string, bytes int64, d time.Duration) {
	hub.mu.RLock()
	defer hub.mu.RUnlock()
	for _, fn := range hub.subs {
		fn(dir, bytes, d)
	}
}

// SubscribeTransfers calls fn for every reported batch until cancel.
func SubscribeTransfers(fn func(dir string, bytes int64, d time.Duration)) (cancel func()) {
	hub.mu.Lock()
	defer hub.mu.Unlock()
	if hub.subs == nil {
		hub.subs = make(map[int]func(string, int64, time.Duration))
	}
	hub.next++
	id := hub.next
	hub.subs[id] = fn
	return func() {
		hub.mu.Lock()
		defer hub.mu.Unlock()
		delete(hub.subs, id)
	}
}

// Timing is one timed transfer batch of a worker, as it travels to a
// leader in another process (the engine's per-step worker metadata).
type Timing struct {
	Dir     string  `msgpack:"dir"`
	Bytes   int64   `msgpack:"bytes"`
	Seconds float64 `msgpack:"secs"`
}

// IsLoad reports whether dir is a load direction the model measures
// (G2 → G1, G3 → G1, G4 → G2).
func IsLoad(dir string) bool {
	switch dir {
	case "g2_to_g1", "g3_to_g1", "g4_to_g2":
		return true
	}
	return false
}

// ObserveTimings feeds batches timed by workers in another process
// (Timing) to the model, as ObserveTransfer.
func (m *Model) ObserveTimings(ts []Timing) {
	for _, t := range ts {
		if t.Seconds >= 0 && t.Seconds < 3600 {
			m.ObserveTransfer(t.Dir, t.Bytes, time.Duration(t.Seconds*float64(time.Second)))
		}
	}
}

// ObserveTransfer feeds a worker's batch to the model: the load directions
// (G2 → G1, G3 → G1, G4 → G2) are measurements of their tier; the others
// (saves, moves, uploads) are ignored.
func (m *Model) ObserveTransfer(dir string, bytes int64, d time.Duration) {
	var t plan.Tier
	switch dir {
	case "g2_to_g1":
		t = plan.G2
	case "g3_to_g1":
		t = plan.G3
	case "g4_to_g2":
		t = plan.G4
	default:
		return
	}
	if bytes > 0 {
		m.ObserveLoad(t, bytes, d)
		i, _ := tierIndex(t)
		m.mu.Lock()
		m.direct[i] = true
		m.mu.Unlock()
	}
}
