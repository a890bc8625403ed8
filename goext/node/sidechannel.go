package node

import (
	"cmp"
	"errors"
	"fmt"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/wire"
)

// LeaderSideChannel is the leader's end of the side channel to its
// tensor-parallel ranks (goext/wire).
type LeaderSideChannel struct {
	Transport string // "auto" (in-process for one worker), "tcp" or "inproc"
	// Heartbeat tuning; 0: defaults (500 ms pings; suspected after
	// DYN_KVBM_LEADER_WORKER_LIVENESS_TIMEOUT_SECS of silence).
	PingInterval, SuspectAfter time.Duration
	// Secret authenticates the channel; DYN_KVBM_LEADER_WORKER_SECRET,
	// when set, wins.
	Secret string
}

// ListenSideChannel binds the leader's end for numWorkers ranks. It only
// binds (a taken port fails at once); the handshake runs in
// Coordinator.Handshake, and its outcome sizes the leader (NewLeader with
// LeaderSpec.SideChannel set to the coordinator).
func ListenSideChannel(cfg *config.Config, o LeaderSideChannel, numWorkers int, d Deps) (*wire.Coordinator, error) {
	tr, err := wire.ParseTransport(o.Transport)
	if err != nil {
		// errprefix: the message names the C export and its option, as before the assembly moved here
		return nil, withKind(KindInvalid, fmt.Errorf("kvbm_leader_new: side_channel: %w", err))
	}
	opts := wire.CoordinatorOptionsFrom(cfg, numWorkers)
	opts.Transport = tr
	opts.PingInterval = o.PingInterval
	opts.Secret = cmp.Or(opts.Secret, o.Secret) // DYN_KVBM_LEADER_WORKER_SECRET wins
	if o.SuspectAfter > 0 {
		opts.SuspectAfter = o.SuspectAfter
	}
	opts.Logger = d.logger()
	opts.InProc = d.registry().hubs
	co, err := wire.Listen(opts)
	if err != nil {
		return nil, withKind(KindIO, err)
	}
	return co, nil
}

// HandshakeKind is the kind of a failed handshake's error: the ranks never
// answered (or the channel closed), or they disagree, failed to allocate
// or have no tier.
func HandshakeKind(err error) Kind {
	if errors.Is(err, wire.ErrHandshakeTimeout) || errors.Is(err, wire.ErrClosed) {
		return KindIO
	}
	return KindConfig
}
