// Package worker is kvbm's byte mover, one per tensor-parallel rank (design §2).
// It holds the engine's registered KV tensors (G1), owns this rank's shard of
// the host (G2) and disk (G3) tiers, and executes the leader's plan.Step:
//
//	BindStep(meta)  ← bind_connector_metadata: decode the step, apply its Drops
//	StartLoad()     ← start_load_kv: launch the step's Loads in the background
//	WaitForSave()   ← wait_for_save: Saves (G1→G2/G3) synchronously; Moves (G2→G3) queued
//	Finished()      ← get_finished: requests whose loads completed, and failed G1 blocks
//
// Loads run asynchronously: the engine does not schedule a loading request
// until Finished reports it, so its G1 blocks are not read meanwhile, and the
// leader keeps the load's sources pinned until then. Saves finish inside
// WaitForSave, which is what lets the leader treat a block saved in step N as
// readable from step N+1 on. Moves run in the background after WaitForSave
// returns (moves.go): a later step that touches a block a queued move still
// reads or writes waits for the queue first, so the same holds for them.
//
// Integrity: the worker remembers, per G2 block, whether it holds valid bytes
// (a save completed), and per G3 block the XXH3 of the block as written. A load
// from a G2 block that was never written or whose save failed, or from a G3
// block whose bytes no longer match, fails: the G1 block is reported in
// Finished's error list and the data is never reported as loaded. The first
// disk I/O error (disk full, EIO) marks the disk tier degraded: later G3
// writes are skipped and G3 reads fail, and the worker carries on with G2.
//
// Metrics split: the worker counts what only it can see — bytes moved per
// direction (kvbm_transfer_bytes, labels g1_to_g2, g2_to_g1, g2_to_g3,
// g1_to_g3, g3_to_g1, g3_to_g2) and batch latency (kvbm_transfer_seconds).
// The leader counts the design §9 block counters (kvbm_offload_blocks_*,
// kvbm_onboard_blocks_*) from its plan, and kvbm_load_errors from the failed
// G1 blocks the engine reports back — once per block, where every
// tensor-parallel worker counting its own failures would count it N times.
package worker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/integrity"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/transfer"
)

// Errors a copy fails with; Finished reports the affected G1 blocks, logs
// carry these.
//
// errprefix: wrapped by the copy's error, which Run's error wraps.
var (
	ErrNotValid     = errors.New("source block holds no valid data (never written, save failed, or dropped)")
	ErrChecksum     = errors.New("disk block checksum mismatch")
	ErrDiskDegraded = errors.New("disk tier disabled after an I/O error")
	ErrNoTier       = errors.New("tier not configured on this worker")
)

// Defaults of DYN_KVBM_MAX_CONCURRENT_TRANSFERS and DYN_KVBM_MAX_TRANSFER_BATCH_SIZE (design §8).
const (
	DefaultMaxConcurrent = 4
	DefaultBatchSize     = 16

	// diskDepth multiplies MaxConcurrent for batches that touch G3.
	diskDepth = 2
)

// diskSlots is the number of disk batches in flight: diskDepth × maxConcurrent,
// except that 1 keeps every transfer serial.
func diskSlots(maxConcurrent int) int {
	if maxConcurrent <= 1 {
		return 1
	}
	return diskDepth * maxConcurrent
}

// Options configure a Worker.
type Options struct {
	// Fingerprint describes what makes this rank's blocks interchangeable
	// with another process's (see package fingerprint): tiers that outlive
	// the process key their blocks by it.
	Fingerprint fingerprint.Inputs
	Rank        int // tensor-parallel rank (disk file name, logs)
	HostBlocks  int // G2 blocks on this rank (0: no host tier)
	DiskBlocks  int // G3 blocks on this rank (0: no disk tier)
	DiskDir     string
	// DiskPersist keeps the disk tier file across restarts (persist.go).
	DiskPersist bool
	// DiskKey authenticates the persistent disk tier's blocks
	// (integrity.LocalKey); required with DiskPersist.
	DiskKey integrity.Key
	// DisableODirect is DYN_KVBM_DISK_DISABLE_O_DIRECT.
	DisableODirect bool
	// DiskZeroFill is DYN_KVBM_DISK_ZEROFILL_FALLBACK: where fallocate is
	// unsupported, write zeros to reserve the disk tier's space.
	DiskZeroFill bool
	// DiskOpenDirect is DYN_KVBM_DISK_ALLOCATOR_TYPE=open-direct: O_DIRECT
	// is passed to open rather than set after it.
	DiskOpenDirect bool
	// NUMA is DYN_KVBM_ENABLE_NUMA: the host tier's pages prefer the NUMA
	// node of the CPU that registers the KV caches.
	NUMA bool
	// MaxConcurrent is DYN_KVBM_MAX_CONCURRENT_TRANSFERS: batches in flight
	// across loads and saves; ≤ 0: DefaultMaxConcurrent.
	MaxConcurrent int
	// BatchSize is DYN_KVBM_MAX_TRANSFER_BATCH_SIZE: blocks per batch; ≤ 0: DefaultBatchSize.
	BatchSize int
	Logger    *slog.Logger     // nil: slog.Default()
	Metrics   *metrics.Metrics // nil: a private set
	// G1 moves blocks between the engine's tensors and host memory when
	// those tensors are not plain host memory (the CUDA build's copier for
	// GPU-resident KV caches). nil: the CPU copies of package transfer.
	// The worker owns it from New on and closes it in Close.
	G1 G1Copier
	// G4 is this rank's object-storage tier (nil: none); see object.go. The
	// caller owns it.
	G4 *object.Store
}

// G1Copier moves whole blocks between the engine's G1 tensors and kvbm host
// memory in the host layout. Hosts buffers handed to it always come from a
// region passed to RegisterHost first.
type G1Copier interface {
	// RegisterHost is called once per host region (G2, disk bounce buffers)
	// before any copy touches it, e.g. to page-lock it.
	RegisterHost(r *storage.HostRegion) error
	// Fence orders the copier's later work after the engine's work submitted
	// so far (a save must see the step's KV; a load must not race the
	// engine's earlier use of a reused block).
	Fence() error
	// GatherBlocks copies G1 blocks[i] into dsts[i]; ScatterBlocks copies
	// srcs[i] into G1 blocks[i]. Both return once the bytes have landed.
	GatherBlocks(blocks []int, dsts [][]byte) error
	ScatterBlocks(blocks []int, srcs [][]byte) error
	// MaxBatch is how many G1↔G2 blocks one call should carry (≤ 0:
	// Options.BatchSize); a device copier prefers whole steps.
	MaxBatch() int
	// Close releases what the copier holds; host regions are unmapped after it.
	Close() error
}

// G1RowCopier is what a G1Copier adds to serve an engine with several KV
// cache groups (layout/groups.go): rows[i] names each group's G1 block at
// one token position, and layer l of the host block dsts[i] (srcs[i]) comes
// from (goes to) rows[i][LayerGroup(l)], in the host layout GatherBlocks
// uses (transfer.GatherRows is the host-memory reference). ScatterRows
// leaves the layers of a group whose entry is layout.NoBlock unwritten;
// GatherRows is given no such entry. Both return once the bytes have landed.
type G1RowCopier interface {
	G1Copier
	GatherRows(rows [][]int64, dsts [][]byte) error
	ScatterRows(rows [][]int64, srcs [][]byte) error
}

// blockDisk is what the worker needs from the disk tier; tests substitute a
// failing one.
type blockDisk interface {
	ReadBlock(i int, buf []byte) error
	WriteBlock(i int, buf []byte) error
}

// Worker executes plan steps on one rank. See the package comment.
type Worker struct {
	opts Options
	log  *slog.Logger
	m    *metrics.Metrics
	lim  *transfer.Limiter

	// Set by RegisterG1 (under mu) and read-only afterwards; ops only run
	// after it returned.
	g1       *layout.Engine
	bpb      int64 // bytes per block (payload)
	host     *storage.HostRegion
	diskFile *storage.DiskRegion
	disk     blockDisk
	bounce   *storage.HostRegion // one aligned block per diskLim slot, for G1↔G3
	// diskLim bounds batches that touch G3. Disk reads need more requests in
	// flight than memory copies to keep the device busy: with 4 batches in
	// flight G3→G1 reads ran at 52–64% of a plain sequential file read, with 8
	// at 105% (bench/transfer), so disk batches get diskDepth× the slots.
	diskLim   *transfer.Limiter
	hostValid []atomic.Bool                   // G2 block holds the bytes of a completed write
	diskValid []atomic.Bool                   // G3 block holds the bytes of a completed write
	diskSum   []atomic.Uint64                 // XXH3 of each G3 block's payload as written
	tags      []atomic.Pointer[plan.BlockTag] // persistent tier: staged tag per G3 block (persist.go)
	hostTags  []atomic.Pointer[plan.HostTag]  // persistent tier: tag of each G2 block's contents, for a side-channel move (persist.go)
	degraded  atomic.Bool
	xfer      transferStats // per-direction totals of this worker (TransferStats)

	saves sync.WaitGroup // WaitForSave and Run calls and the move queue's goroutine in progress (Close waits for them before unmapping)

	// exec serialises Run with the engine's per-step calls: Bind (its
	// drops), StartLoad (the launch; the loads themselves run after it
	// returns) and WaitForSave (all of it). See Run for the ordering. A
	// one-slot channel rather than a mutex, so that Run can stop waiting for
	// it when its context ends.
	exec chan struct{}

	mu       sync.Mutex // guards the fields below, to the end of the struct
	step     *plan.Step // the bound step
	loadsRun bool       // the bound step's Loads were started
	savesRun bool       // the bound step's Moves/Saves ran
	lastSeq  uint64
	loaded   []string // requests whose loads completed since the last Finished
	loadErrs []int64  // G1 blocks whose load failed since the last Finished
	// requests among loaded with a failed G1 block
	loadFailedReqs []string
	closed         bool
	savedSeq       uint64 // highest Seq of a bound step whose Moves/Saves finished
	// saved is closed (and replaced) when savedSeq grows or the worker
	// closes: a Run waiting for a step's saves selects on it and on its
	// context, which a sync.Cond could not.
	saved chan struct{}
	// loading counts the background load goroutines (started by StartLoad,
	// waited for by WaitLoads and Close). Not a sync.WaitGroup: the engine
	// may call WaitLoads from one thread while the next step's StartLoad
	// runs on another, and a WaitGroup forbids Add during such a Wait.
	loading     int
	loadingDone *sync.Cond // on mu: broadcast when loading drops to 0
	moves       moveQueue  // G2→G3 moves queued by WaitForSave (moves.go)
	movesDone   *sync.Cond // on mu: broadcast when a queued step's moves have run
}

// New validates opts. Regions are allocated by RegisterG1, once the block size is known.
func New(opts Options) (*Worker, error) {
	if opts.HostBlocks < 0 || opts.DiskBlocks < 0 {
		return nil, fmt.Errorf("worker: rank %d: host blocks %d, disk blocks %d: must not be negative", opts.Rank, opts.HostBlocks, opts.DiskBlocks)
	}
	if opts.HostBlocks == 0 && opts.DiskBlocks == 0 {
		return nil, fmt.Errorf("worker: rank %d: no host or disk blocks: configure DYN_KVBM_CPU_CACHE_GB and/or DYN_KVBM_DISK_CACHE_GB", opts.Rank)
	}
	if opts.MaxConcurrent <= 0 {
		opts.MaxConcurrent = DefaultMaxConcurrent
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = DefaultBatchSize
	}
	w := &Worker{opts: opts, log: opts.Logger, m: opts.Metrics, lim: transfer.NewLimiter(opts.MaxConcurrent),
		diskLim: transfer.NewLimiter(diskSlots(opts.MaxConcurrent)),
		exec:    make(chan struct{}, 1), saved: make(chan struct{})}
	w.loadingDone = sync.NewCond(&w.mu)
	w.movesDone = sync.NewCond(&w.mu)
	if w.log == nil {
		w.log = slog.Default()
	}
	w.log = w.log.With("rank", opts.Rank)
	if w.m == nil {
		w.m = metrics.New()
	}
	return w, nil
}

// currentNUMANode is storage.CurrentNUMANode; tests give other topologies.
var currentNUMANode = storage.CurrentNUMANode

// numaNode is the NUMA node the host tier goes on (DYN_KVBM_ENABLE_NUMA):
// the node of the CPU running this call, or -1 where that means nothing (a
// single node) or cannot be told.
func (w *Worker) numaNode() int {
	node, nodes, err := currentNUMANode()
	switch {
	case err != nil:
		w.log.Warn("kvbm DYN_KVBM_ENABLE_NUMA: cannot tell this CPU's NUMA node; the host tier uses the "+
			"default memory policy", "rank", w.opts.Rank, "err", err)
		return -1
	case nodes <= 1:
		w.log.Info("kvbm DYN_KVBM_ENABLE_NUMA: this machine has one NUMA node; placing the host tier on it "+
			"is a no-op", "rank", w.opts.Rank)
		return -1
	}
	return node
}

// RegisterG1 registers the engine's KV tensors (their memory stays the
// engine's and must outlive the worker) and allocates the host and disk tiers
// for e.BytesPerBlock(). It may be called once.
func (w *Worker) RegisterG1(e *layout.Engine) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return errors.New("worker: worker is closed")
	}
	if w.g1 != nil {
		return errors.New("worker: KV caches already registered with this worker")
	}
	if e == nil {
		return errors.New("worker: register KV caches: nil layout")
	}
	for i := 0; i < e.Tensors(); i++ {
		if e.Base(i) == 0 {
			return fmt.Errorf("worker: register KV caches: tensor %d has a null data pointer", i)
		}
	}
	bpb := e.BytesPerBlock()
	var err error
	cleanup := func() {
		for _, c := range []interface{ Close() error }{w.host, w.diskFile, w.bounce} {
			if c != nil && !isNilRegion(c) {
				_ = c.Close()
			}
		}
		w.host, w.diskFile, w.disk, w.bounce = nil, nil, nil, nil
	}
	if w.opts.HostBlocks > 0 {
		node := -1
		if w.opts.NUMA {
			node = w.numaNode()
		}
		w.host, err = storage.NewHostRegionOnNode(w.opts.HostBlocks, bpb, true, node)
		if node >= 0 && errors.Is(err, storage.ErrNUMAPolicy) {
			w.log.Warn("kvbm DYN_KVBM_ENABLE_NUMA: the host tier cannot be placed on a NUMA node here; "+
				"it uses the default memory policy", "rank", w.opts.Rank, "err", err)
			w.host, err = storage.NewHostRegion(w.opts.HostBlocks, bpb, true)
		}
		if err != nil {
			return fmt.Errorf("worker: rank %d: %w", w.opts.Rank, err)
		}
		if node >= 0 {
			w.log.Info("kvbm host tier placed on NUMA node (DYN_KVBM_ENABLE_NUMA)", "rank", w.opts.Rank,
				"numa_node", node)
		}
		w.hostValid = make([]atomic.Bool, w.opts.HostBlocks)
	}
	if w.opts.DiskBlocks > 0 {
		w.diskFile, err = storage.NewDiskRegion(storage.DiskOptions{
			Dir: w.opts.DiskDir, Rank: w.opts.Rank, NumBlocks: w.opts.DiskBlocks, BlockBytes: bpb,
			DisableODirect: w.opts.DisableODirect, ZeroFill: w.opts.DiskZeroFill,
			OpenDirect: w.opts.DiskOpenDirect, Logger: w.log,
			Persist: w.opts.DiskPersist, Fingerprint: w.opts.Fingerprint.Sum(), Key: w.opts.DiskKey,
		})
		if err != nil {
			cleanup()
			return fmt.Errorf("worker: rank %d: %w", w.opts.Rank, err)
		}
		w.disk = w.diskFile
		if w.bounce, err = storage.NewHostRegion(w.diskLim.Slots(), bpb, true); err != nil {
			cleanup()
			return fmt.Errorf("worker: rank %d: disk bounce buffers: %w", w.opts.Rank, err)
		}
		w.diskValid = make([]atomic.Bool, w.opts.DiskBlocks)
		w.diskSum = make([]atomic.Uint64, w.opts.DiskBlocks)
		w.adoptRecovered()
	}
	if c := w.opts.G1; c != nil {
		for _, r := range []*storage.HostRegion{w.host, w.bounce} {
			if r == nil {
				continue
			}
			if err = c.RegisterHost(r); err != nil {
				cleanup()
				return fmt.Errorf("worker: rank %d: register host memory with the G1 copier: %w", w.opts.Rank, err)
			}
		}
	}
	w.g1, w.bpb = e, bpb
	w.log.Info("kvbm worker registered KV caches", "layout", e.String(), "host_blocks", w.opts.HostBlocks, "disk_blocks", w.opts.DiskBlocks)
	return nil
}

// isNilRegion reports whether c is a typed nil pointer inside the interface.
func isNilRegion(c interface{ Close() error }) bool {
	switch r := c.(type) {
	case *storage.HostRegion:
		return r == nil
	case *storage.DiskRegion:
		return r == nil
	}
	return false
}

// BytesPerBlock is this rank's share of one block (0 before RegisterG1).
func (w *Worker) BytesPerBlock() int64 { return w.bpb }

// DiskPath is the disk tier file ("" without a disk tier).
func (w *Worker) DiskPath() string {
	if w.diskFile == nil {
		return ""
	}
	return w.diskFile.Path()
}

// DiskDirect reports whether the disk tier uses O_DIRECT (false without one).
func (w *Worker) DiskDirect() bool { return w.diskFile != nil && w.diskFile.Direct() }

// DiskDegraded reports whether a disk I/O error switched the disk tier off.
func (w *Worker) DiskDegraded() bool { return w.degraded.Load() }

// savedChangedLocked wakes every Run waiting on saved; mu is held.
func (w *Worker) savedChangedLocked() {
	close(w.saved)
	w.saved = make(chan struct{})
}

// lockExec takes the execution lock (see exec).
func (w *Worker) lockExec() { w.exec <- struct{}{} }

// lockExecContext takes the execution lock unless ctx ends first.
func (w *Worker) lockExecContext(ctx context.Context) error {
	select {
	case w.exec <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (w *Worker) unlockExec() { <-w.exec }

// Close waits for in-flight loads and queued moves, then releases the host region and removes
// the disk file. The engine's tensors are untouched.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	w.savedChangedLocked() // a Run waiting for a step's saves gives up
	// Nothing new starts once closed is set; wait for what is running
	// before the regions it copies into disappear.
	w.waitLoadsLocked()
	w.mu.Unlock()
	w.saves.Wait()
	var errs []error
	if w.opts.G1 != nil {
		// Before the regions go: a copier may hold them registered (pinned).
		errs = append(errs, w.opts.G1.Close())
	}
	for _, c := range []interface{ Close() error }{w.host, w.diskFile, w.bounce} {
		if c != nil && !isNilRegion(c) {
			errs = append(errs, c.Close())
		}
	}
	return errors.Join(errs...)
}
