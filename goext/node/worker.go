package node

import (
	"cmp"
	"fmt"
	"log/slog"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/wire"
	"github.com/kvbm/kvbm/goext/worker"
)

// WorkerSpec is what the engine tells about one rank: its KV tensors and
// its place in the tensor-parallel group.
type WorkerSpec struct {
	Layout     layout.Spec
	Rank       int
	NumWorkers int // tensor-parallel size; ≤ 0: 1
	// Model and DType identify the weights and element type: with the
	// layout they form the fingerprint of blocks kept beyond this process.
	Model, DType string
	// WorkerID is the engine instance's id ({worker_id} in DYN_KVBM_OBJECT_BUCKET).
	WorkerID uint64
	// SideChannel, when set, connects this rank to the leader's side
	// channel (TP > 1, the leader in another process).
	SideChannel *WorkerSideChannel
}

// WorkerSideChannel is the worker's end of the side channel.
type WorkerSideChannel struct {
	Transport string // "auto", "tcp" or "inproc"
	Secret    string // DYN_KVBM_LEADER_WORKER_SECRET, when set, wins
}

// Worker is one rank assembled: its worker, G1 copier, G4 store and side
// channel. Close releases them.
type Worker struct {
	W       *worker.Worker
	G1      worker.G1Copier // nil: G1 is host memory
	G4      *object.Store   // nil without a G4 tier
	Member  *wire.Member    // the side channel; nil without one
	Layout  *layout.Engine
	Metrics *metrics.Metrics
	// Fingerprint of this rank's blocks (fingerprint.Inputs.Sum).
	Fingerprint fingerprint.Fingerprint
	// FingerprintOf describes the fingerprint's inputs.
	FingerprintOf string
	// HostBlocks and DiskBlocks are this rank's G2 and G3 sizes.
	HostBlocks, DiskBlocks int
	// Recovered is the persistent disk tier's recovered index (msgpack
	// RecoveredRank, for Leader.RestoreDisk); nil without persistence.
	Recovered []byte

	closers undo
}

// NewWorker builds one rank from cfg: G1 copier, G4 store (shared through
// the Registry), worker, registered engine tensors, persistent disk tier's
// hand-over, side channel, in that order. On error everything opened so
// far is closed, the last opened first.
func NewWorker(cfg *config.Config, spec WorkerSpec, d Deps) (_ *Worker, err error) {
	reg, log := d.registry(), d.logger()
	eng, err := layout.NewEngine(spec.Layout)
	if err != nil {
		return nil, err
	}
	nw := max(spec.NumWorkers, 1)
	hostBlocks, diskBlocks, err := cfg.TierBlocks(eng.BytesPerBlock(), nw)
	if err != nil {
		return nil, withKind(KindConfig, err)
	}
	n := &Worker{Layout: eng, Metrics: reg.WorkerMetrics(), HostBlocks: hostBlocks, DiskBlocks: diskBlocks}
	defer func() {
		if err != nil {
			n.closers.run()
		}
	}()
	if d.NewCopier != nil {
		if n.G1, err = d.NewCopier(eng, cfg); err != nil {
			return nil, withKind(KindIO, err)
		}
	}
	owned := false // the worker closes the copier once it has it
	if n.G1 != nil {
		g1 := n.G1
		n.closers.push(func() {
			if !owned {
				_ = g1.Close()
			}
		})
		if err := checkGroupsCopier(eng, g1); err != nil {
			return nil, err
		}
	}
	fp := fingerprint.FromEngine(spec.Model, spec.DType, eng, nw, spec.Rank)
	n.Fingerprint, n.FingerprintOf = fp.Sum(), fp.Describe()
	if err := cfg.CheckObject(); err != nil {
		return nil, withKind(KindConfig, err)
	}
	if cfg.Object.Enabled {
		s, release, err := reg.OpenG4(cfg, n.Fingerprint, eng.BytesPerBlock(), spec.WorkerID, log, d.TuneStore)
		if err != nil {
			return nil, err
		}
		n.G4 = s
		n.closers.push(release)
	}
	diskKey, err := g3Key(cfg)
	if err != nil {
		return nil, withKind(KindConfig, err)
	}
	w, err := worker.New(worker.Options{
		G4:          n.G4,
		Fingerprint: fp,
		Rank:        spec.Rank, HostBlocks: hostBlocks, DiskBlocks: diskBlocks, DiskDir: cfg.DiskCacheDir,
		DiskPersist: cfg.DiskPersist, DiskKey: diskKey, DiskZeroFill: cfg.DiskZerofillFallback,
		DiskOpenDirect: cfg.DiskAllocatorType == config.DiskAllocatorOpenDirect, NUMA: cfg.EnableNUMA,
		DisableODirect: cfg.DiskDisableODirect, MaxConcurrent: cfg.MaxConcurrentTransfers,
		BatchSize: cfg.MaxTransferBatchSize, Logger: log, Metrics: n.Metrics, G1: n.G1,
	})
	if err != nil {
		return nil, withKind(KindConfig, err)
	}
	owned = true
	n.W = w
	n.closers.push(func() { _ = w.Close() })
	if err := w.RegisterG1(eng); err != nil {
		return nil, withKind(KindIO, err)
	}
	if w.DiskPersistent() {
		n.Recovered = encodeRecovered(spec.Rank, nw, w.Recovered())
	}
	log.Info("kvbm worker ready", "rank", spec.Rank, "layout", eng.String(), "bytes_per_block", eng.BytesPerBlock(),
		"host_blocks", hostBlocks, "disk_blocks", diskBlocks, "disk_file", w.DiskPath(),
		"fingerprint", n.Fingerprint.String(), "fingerprint_of", n.FingerprintOf)
	if spec.SideChannel != nil {
		if n.Member, err = n.connect(spec.SideChannel, cfg, spec.Rank, nw, log, reg.hubs); err != nil {
			return nil, err
		}
		m := n.Member
		n.closers.push(func() { _ = m.Close() })
	}
	return n, nil
}

// checkGroupsCopier refuses KV cache groups with a G1 copier that moves
// only whole blocks of one block table (not a worker.G1RowCopier).
func checkGroupsCopier(eng *layout.Engine, g1 worker.G1Copier) error {
	if eng.NumGroups() <= 1 {
		return nil
	}
	if _, ok := g1.(worker.G1RowCopier); ok {
		return nil
	}
	// errprefix: the message names the C export the engine called, as before the assembly moved here
	return withKind(KindConfig, fmt.Errorf("kvbm_worker_new: %d KV cache groups (layer groups %v): "+
		"the G1 copier %T does not copy per KV cache group", eng.NumGroups(), eng.LayerGroups(), g1))
}

// connect attaches the worker's side channel: the handshake completes in
// the background when the leader runs it, checking that the leader's tier
// sizes equal this rank's own; operations run on the worker through
// worker.Run, outside the engine's bound step and serialised with its
// bind/start_load/wait_for_save.
func (n *Worker) connect(o *WorkerSideChannel, cfg *config.Config, rank, numWorkers int, log *slog.Logger,
	hubs *wire.InProcHubs) (*wire.Member, error) {
	tr, err := wire.ParseTransport(o.Transport)
	if err != nil {
		// errprefix: the message names the C export and its option, as before the assembly moved here
		return nil, withKind(KindInvalid, fmt.Errorf("kvbm_worker_new: side_channel: %w", err))
	}
	return wire.Connect(wire.MemberOptions{
		Rank: rank, WorldSize: numWorkers, NumDeviceBlocks: n.Layout.NumBlocks,
		BytesPerBlock: n.Layout.BytesPerBlock(), Endpoint: wire.EndpointFrom(cfg), Transport: tr,
		Secret: cmp.Or(cfg.LeaderWorkerSecret, o.Secret), Logger: log, InProc: hubs,
		Allocate: wire.ExpectSizes(n.HostBlocks, n.DiskBlocks),
		Execute:  wire.RunOn(n.W),
	})
}

// Interrupt begins a close: the side channel stops, so that an operation
// waiting for the engine's step gives up and no new one arrives. Close
// follows, once the calls in progress returned.
func (n *Worker) Interrupt() {
	if n.Member != nil {
		_ = n.Member.Close()
	}
}

// Close releases everything NewWorker opened, the last opened first: the
// side channel, then the worker (and its copier and regions), then the G4
// store.
func (n *Worker) Close() { n.closers.run() }
