package node

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/consolidator"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/leader"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
)

// LeaderSpec is what the engine tells the leader at start.
type LeaderSpec struct {
	BlockSize     int
	BytesPerBlock int64 // one rank's share of a block
	NumWorkers    int   // tensor-parallel size; ≤ 0: 1
	WorkerID      uint64
	// Background: G2→G3 moves leave the step plans (leader.Options.Background).
	Background bool
	// SideChannel to the tensor-parallel ranks (the wire.Coordinator);
	// nil without one. BroadcastTimeout bounds one operation over it.
	SideChannel      leader.Broadcaster
	BroadcastTimeout time.Duration
	// Consolidator, when set, starts the KV event consolidator and feeds it
	// the leader's G2/G3 events.
	Consolidator *ConsolidatorSpec
	// Fingerprint (hex) of rank 0's blocks, for G4 lookups; empty: given
	// later (Leader.SetG4Fingerprint), as the engine learns it.
	Fingerprint string
	G4Async     bool // the engine asks again when a match answers Pending
	LoadFullHit bool // leader.Options.LoadFullHit
	// Groups: the engine's KV cache groups (leader.Options.Groups).
	Groups *leader.Groups
	// TierEvents keeps the G2/G3/G4 store and removal events in
	// Leader.TierEvents for the engine to publish.
	TierEvents bool
	// Metrics the leader records into; nil: a new set.
	Metrics *metrics.Metrics
}

// Leader is an engine instance's leader assembled: the leader and what it
// feeds (consolidator, tier event buffer, G4 store, metrics endpoint).
type Leader struct {
	L            *leader.Leader
	Metrics      *metrics.Metrics
	Server       *metrics.Server            // the metrics endpoint; nil when off or not started
	Consolidator *consolidator.Consolidator // nil unless started with the leader
	TierEvents   *events.Buffer             // nil unless LeaderSpec.TierEvents

	cfg           *config.Config
	deps          Deps
	bytesPerBlock int64
	workerID      uint64

	g4mu    sync.Mutex // SetG4Fingerprint vs Close
	g4Close func()     // releases the G4 store; nil without one

	closers undo
}

// NewLeader builds a leader from cfg: consolidator, tier event buffer, G4
// store, leader, the persistent disk tier's in-process restore, metrics
// endpoint, in that order. On error everything opened so far is closed,
// the last opened first.
//
// Lock order: the leader calls its events.Sink (the consolidator, the tier
// event buffer) while holding its own lock; neither calls back into the
// leader. See the package comment.
func NewLeader(cfg *config.Config, spec LeaderSpec, d Deps) (_ *Leader, err error) {
	reg, log := d.registry(), d.logger()
	n := &Leader{Metrics: spec.Metrics, cfg: cfg, deps: d, bytesPerBlock: spec.BytesPerBlock, workerID: spec.WorkerID}
	if n.Metrics == nil {
		n.Metrics = metrics.New()
	}
	defer func() {
		if err != nil {
			n.closers.run()
		}
	}()
	nw := max(spec.NumWorkers, 1)
	var sink events.Sink = events.NopSink{}
	if spec.Consolidator != nil {
		c, err := NewConsolidator(cfg, *spec.Consolidator, n.Metrics, log)
		if err != nil {
			return nil, err
		}
		n.Consolidator, sink = c, c
		n.closers.push(func() { _ = c.Close() })
	}
	if spec.TierEvents {
		n.TierEvents = events.NewBuffer(0)
		if _, nop := sink.(events.NopSink); nop {
			sink = n.TierEvents
		} else {
			sink = events.Tee{sink, n.TierEvents}
		}
	}
	n.closers.push(n.releaseG4)
	g4opts, err := n.g4Options(spec, reg, log)
	if err != nil {
		return nil, err
	}
	if g4opts != nil && n.TierEvents != nil {
		g4opts.Events = n.TierEvents
	}
	l, err := leader.New(leader.Options{
		G4:               g4opts,
		Config:           cfg,
		BlockSize:        spec.BlockSize,
		BytesPerBlock:    spec.BytesPerBlock,
		NumWorkers:       nw,
		Sink:             sink,
		Metrics:          n.Metrics,
		Logger:           log,
		WorkerID:         spec.WorkerID,
		Now:              d.Now,
		Background:       spec.Background,
		SideChannel:      spec.SideChannel,
		BroadcastTimeout: spec.BroadcastTimeout,
		LoadFullHit:      spec.LoadFullHit,
		Groups:           spec.Groups,
		ObserveTransfers: true, // this process's workers time their loads (goext/policy)
	})
	if err != nil {
		return nil, withKind(KindConfig, err)
	}
	n.L = l
	n.closers.push(l.Close)
	if g4opts != nil {
		_ = object.RegisterMetrics(n.Metrics.Registry)
	}
	n.startAdmin(cfg, l, log)
	if cfg.Metrics {
		// Transfer bytes and latency are measured by the workers of this
		// process (TP=1: the engine's only worker shares it).
		n.Metrics.Also = reg.WorkerMetrics().Families("kvbm_transfer_bytes", "kvbm_transfer_seconds",
			"kvbm_g3_load_unauthenticated_blocks")
		srv, err := n.Metrics.ServeWith(cfg.MetricsAddr(), metrics.ServerOptionsFrom(cfg))
		if err != nil {
			// The cache works without its metrics endpoint; say why it is missing.
			log.Warn("kvbm metrics endpoint not started", "err", err)
		} else {
			n.Server = srv
			n.closers.push(func() { _ = srv.Close() })
			log.Info("kvbm metrics endpoint", "url", "http://"+srv.Addr+"/metrics")
		}
	}
	return n, nil
}

// g4Options configures the leader's G4 tier (nil when off). Rank 0's store
// (lookups, the registry) is opened when its fingerprint is known: given in
// the spec, or later by the engine (SetG4Fingerprint, from what rank 0's
// worker reports: one route whatever the process layout); until then the
// leader plans uploads but matches nothing in G4.
func (n *Leader) g4Options(spec LeaderSpec, reg *Registry, log *slog.Logger) (*leader.G4Options, error) {
	cfg := n.cfg
	if !cfg.Object.Enabled {
		return nil, nil
	}
	if err := cfg.CheckObject(); err != nil {
		return nil, withKind(KindConfig, err)
	}
	opts := &leader.G4Options{Async: spec.G4Async, WriteThrough: cfg.Object.WriteThrough,
		Registry: object.NewRegistry(cfg.Object.NumBlocks), LookupTimeout: cfg.Object.LookupTimeout}
	var fp fingerprint.Fingerprint
	if spec.Fingerprint != "" {
		var err error
		if fp, err = fingerprint.Parse(spec.Fingerprint); err != nil {
			// errprefix: the message names the C export, as before the assembly moved here
			return nil, withKind(KindInvalid, fmt.Errorf("kvbm_leader_new: %w", err))
		}
	}
	if fp.IsZero() {
		log.Info("kvbm G4: waiting for rank 0's block fingerprint from its worker before matching in G4")
		return opts, nil
	}
	s, release, err := reg.OpenG4(cfg, fp, spec.BytesPerBlock, spec.WorkerID, log, n.deps.TuneStore)
	if err != nil {
		return nil, err
	}
	n.g4mu.Lock()
	n.g4Close = release
	n.g4mu.Unlock()
	opts.Store = s
	return opts, nil
}

// SetG4Fingerprint opens rank 0's store for the leader once the engine
// learned its fingerprint from rank 0's worker; a leader that already has
// it, or has no G4 tier, ignores it. It does no network I/O: G4 turns on
// when the store's bucket check succeeds.
func (n *Leader) SetG4Fingerprint(fp fingerprint.Fingerprint) error {
	n.g4mu.Lock()
	defer n.g4mu.Unlock()
	if !n.L.G4Enabled() || n.L.G4Store() != nil {
		return nil
	}
	log := n.deps.logger()
	s, release, err := n.deps.registry().OpenG4(n.cfg, fp, n.bytesPerBlock, n.workerID, log, n.deps.TuneStore)
	if err != nil {
		return err
	}
	if !n.L.SetG4Store(s) {
		release()
		return nil
	}
	n.g4Close = release
	log.Info("kvbm G4: matching with rank 0's fingerprint once its bucket answers", "fingerprint", fp.String())
	return nil
}

func (n *Leader) releaseG4() {
	n.g4mu.Lock()
	defer n.g4mu.Unlock()
	if n.g4Close != nil {
		n.g4Close()
		n.g4Close = nil
	}
}

// RestoreDisk registers the G3 blocks every rank recovered (each a
// Worker.Recovered, rank 0 first; before the first step) and returns how
// many blocks.
func (n *Leader) RestoreDisk(ranks []RecoveredRank) (int, error) {
	return restoreRanks(n.L, ranks, n.Metrics)
}

// Close releases everything NewLeader opened, the last opened first: the
// metrics endpoint, the leader (its background loop cancels the operation
// in flight and stops using the side channel), the G4 store, the
// consolidator (the leader's sink, after the leader).
func (n *Leader) Close() { n.closers.run() }
