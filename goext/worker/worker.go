// Package worker is kvbm's byte mover, one per tensor-parallel rank (design §2).
// It holds the engine's registered KV tensors (G1), owns this rank's shard of
// the host (G2) and disk (G3) tiers, and executes the leader's plan.Step:
//
//	BindStep(meta)  ← bind_connector_metadata: decode the step, apply its Drops
//	StartLoad()     ← start_load_kv: launch the step's Loads in the background
//	WaitForSave()   ← wait_for_save: Moves (G2→G3), then Saves (G1→G2/G3), synchronously
//	Finished()      ← get_finished: requests whose loads completed, and failed G1 blocks
//
// Loads run asynchronously: the engine does not schedule a loading request
// until Finished reports it, so its G1 blocks are not read meanwhile, and the
// leader keeps the load's sources pinned until then. Moves and Saves finish
// inside WaitForSave, which is what lets the leader treat a block saved in
// step N as readable from step N+1 on.
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
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/layout"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/storage"
	"github.com/kvbm/kvbm/goext/transfer"
)

// Errors a copy fails with; Finished reports the affected G1 blocks, logs
// carry these.
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
	// DisableODirect is DYN_KVBM_DISK_DISABLE_O_DIRECT.
	DisableODirect bool
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
	degraded  atomic.Bool

	saves sync.WaitGroup // WaitForSave and Run calls in progress (Close waits for them before unmapping)

	// exec serialises Run with the engine's per-step calls: Bind (its
	// drops), StartLoad (the launch; the loads themselves run after it
	// returns) and WaitForSave (all of it). See Run for the ordering.
	exec sync.Mutex

	mu       sync.Mutex // guards everything below
	step     *plan.Step // the bound step
	loadsRun bool       // the bound step's Loads were started
	savesRun bool       // the bound step's Moves/Saves ran
	lastSeq  uint64
	loaded   []string // requests whose loads completed since the last Finished
	loadErrs []int64  // G1 blocks whose load failed since the last Finished
	closed   bool
	savedSeq uint64     // highest Seq of a bound step whose Moves/Saves finished
	saved    *sync.Cond // on mu: signalled when savedSeq grows or the worker closes
	// loading counts the background load goroutines (started by StartLoad,
	// waited for by WaitLoads and Close). Not a sync.WaitGroup: the engine
	// may call WaitLoads from one thread while the next step's StartLoad
	// runs on another, and a WaitGroup forbids Add during such a Wait.
	loading     int
	loadingDone *sync.Cond // on mu: broadcast when loading drops to 0
}

// New validates opts. Regions are allocated by RegisterG1, once the block size is known.
func New(opts Options) (*Worker, error) {
	if opts.HostBlocks < 0 || opts.DiskBlocks < 0 {
		return nil, fmt.Errorf("worker rank %d: host blocks %d, disk blocks %d: must not be negative", opts.Rank, opts.HostBlocks, opts.DiskBlocks)
	}
	if opts.HostBlocks == 0 && opts.DiskBlocks == 0 {
		return nil, fmt.Errorf("worker rank %d: no host or disk blocks: configure DYN_KVBM_CPU_CACHE_GB and/or DYN_KVBM_DISK_CACHE_GB", opts.Rank)
	}
	if opts.MaxConcurrent <= 0 {
		opts.MaxConcurrent = DefaultMaxConcurrent
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = DefaultBatchSize
	}
	w := &Worker{opts: opts, log: opts.Logger, m: opts.Metrics, lim: transfer.NewLimiter(opts.MaxConcurrent),
		diskLim: transfer.NewLimiter(diskSlots(opts.MaxConcurrent))}
	w.saved = sync.NewCond(&w.mu)
	w.loadingDone = sync.NewCond(&w.mu)
	if w.log == nil {
		w.log = slog.Default()
	}
	w.log = w.log.With("rank", opts.Rank)
	if w.m == nil {
		w.m = metrics.New()
	}
	return w, nil
}

// RegisterG1 registers the engine's KV tensors (their memory stays the
// engine's and must outlive the worker) and allocates the host and disk tiers
// for e.BytesPerBlock(). It may be called once.
func (w *Worker) RegisterG1(e *layout.Engine) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return errors.New("worker is closed")
	}
	if w.g1 != nil {
		return errors.New("KV caches already registered with this worker")
	}
	if e == nil {
		return errors.New("register KV caches: nil layout")
	}
	for i := 0; i < e.Tensors(); i++ {
		if e.Base(i) == 0 {
			return fmt.Errorf("register KV caches: tensor %d has a null data pointer", i)
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
		if w.host, err = storage.NewHostRegion(w.opts.HostBlocks, bpb, true); err != nil {
			return fmt.Errorf("worker rank %d: %w", w.opts.Rank, err)
		}
		w.hostValid = make([]atomic.Bool, w.opts.HostBlocks)
	}
	if w.opts.DiskBlocks > 0 {
		w.diskFile, err = storage.NewDiskRegion(storage.DiskOptions{
			Dir: w.opts.DiskDir, Rank: w.opts.Rank, NumBlocks: w.opts.DiskBlocks, BlockBytes: bpb,
			DisableODirect: w.opts.DisableODirect, Logger: w.log,
			Persist: w.opts.DiskPersist, Fingerprint: w.opts.Fingerprint.Sum(),
		})
		if err != nil {
			cleanup()
			return fmt.Errorf("worker rank %d: %w", w.opts.Rank, err)
		}
		w.disk = w.diskFile
		if w.bounce, err = storage.NewHostRegion(w.diskLim.Slots(), bpb, true); err != nil {
			cleanup()
			return fmt.Errorf("worker rank %d: disk bounce buffers: %w", w.opts.Rank, err)
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
				return fmt.Errorf("worker rank %d: register host memory with the G1 copier: %w", w.opts.Rank, err)
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

// BindStep decodes the leader's step and applies its Drops. If the engine
// skipped StartLoad or WaitForSave for the previous step, they run now: a
// step's work is never silently lost.
func (w *Worker) BindStep(b []byte) error {
	s, err := plan.Decode(b)
	if err != nil {
		return fmt.Errorf("worker rank %d: %w", w.opts.Rank, err)
	}
	return w.Bind(s)
}

// Bind is BindStep for an already decoded step.
func (w *Worker) Bind(s *plan.Step) error {
	w.mu.Lock()
	if w.g1 == nil {
		w.mu.Unlock()
		return errors.New("bind step: KV caches not registered yet")
	}
	prev := w.step
	startPrev := prev != nil && !w.loadsRun
	savePrev := prev != nil && !w.savesRun
	w.mu.Unlock()
	if startPrev {
		w.log.Debug("kvbm worker: previous step's loads were not started; starting them now", "seq", prev.Seq)
		w.StartLoad()
	}
	if savePrev {
		w.log.Debug("kvbm worker: previous step's saves did not run; running them now", "seq", prev.Seq)
		w.WaitForSave()
	}

	w.exec.Lock()
	defer w.exec.Unlock()
	w.mu.Lock()
	if s.Seq != 0 && s.Seq <= w.lastSeq {
		w.log.Warn("kvbm worker: step sequence went backwards; executing anyway", "seq", s.Seq, "last", w.lastSeq)
	}
	w.lastSeq = max(w.lastSeq, s.Seq)
	w.step, w.loadsRun, w.savesRun = s, false, false
	if len(s.Moves) == 0 && len(s.Saves) == 0 && len(s.Uploads) == 0 {
		// Nothing to save: the step is saved as soon as it is bound. An
		// engine step without a forward pass may never call WaitForSave, and
		// a side-channel operation planned after it (Run with this Seq) must
		// not wait for the next step, which an idle engine never sends.
		w.savesRun = true
		if s.Seq > w.savedSeq {
			w.savedSeq = s.Seq
			w.saved.Broadcast()
		}
	}
	w.mu.Unlock()
	// Drops first: the leader may drop a block and hand it out again in the
	// same step, so the step's own writes must land after the drop.
	w.applyDrops(s.Drops)
	w.stageTags(s)
	return nil
}

func (w *Worker) applyDrops(drops []plan.Copy) {
	for _, d := range drops {
		// A drop names its block as the copy's source.
		switch {
		case d.Src == plan.G2 && d.SrcBlock >= 0 && d.SrcBlock < int64(len(w.hostValid)):
			w.hostValid[d.SrcBlock].Store(false)
		case d.Src == plan.G3 && d.SrcBlock >= 0 && d.SrcBlock < int64(len(w.diskValid)):
			w.diskValid[d.SrcBlock].Store(false)
			w.diskSum[d.SrcBlock].Store(0)
			w.forgetOnDisk(int(d.SrcBlock))
		default:
			w.log.Warn("kvbm worker: ignoring drop of an unknown block", "tier", d.Src, "block", d.SrcBlock)
		}
	}
}

// StartLoad launches the bound step's Loads in the background; Finished
// reports them once done. Copies into G2 (G3→G2 staging) run before the
// copies into G1 of the same step, so a load may stage through G2.
func (w *Worker) StartLoad() {
	w.exec.Lock()
	defer w.exec.Unlock()
	w.mu.Lock()
	s := w.step
	if s == nil || w.loadsRun || w.closed {
		w.mu.Unlock()
		return
	}
	w.loadsRun = true
	if len(s.Loads) == 0 {
		w.mu.Unlock()
		return
	}
	w.loading++
	w.mu.Unlock()
	w.fence("load")
	go func() {
		defer w.loadFinished()
		w.runLoads(s.Loads)
	}()
}

// loadFinished is the last thing a load goroutine does.
func (w *Worker) loadFinished() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.loading--; w.loading == 0 {
		w.loadingDone.Broadcast()
	}
}

// waitLoadsLocked waits, with mu held, until no load goroutine runs.
func (w *Worker) waitLoadsLocked() {
	for w.loading > 0 {
		w.loadingDone.Wait()
	}
}

func (w *Worker) runLoads(loads []plan.Load) {
	failed := w.execLoads(loads)
	w.mu.Lock()
	for _, ld := range loads {
		w.loaded = append(w.loaded, ld.ReqID)
	}
	w.loadErrs = append(w.loadErrs, failed...)
	w.mu.Unlock()
}

// execLoads copies loads' blocks, staging copies (into G2) before copies into
// G1, and returns the G1 blocks whose copy failed.
func (w *Worker) execLoads(loads []plan.Load) (failed []int64) {
	var staging, direct []plan.Copy
	for _, ld := range loads {
		for _, c := range ld.Copies {
			if c.Dst == plan.G1 {
				direct = append(direct, c)
			} else {
				staging = append(staging, c)
			}
		}
	}
	downloads, staging := splitDownloads(staging)
	if errs := w.runDownloads(downloads); countErrs(errs) > 0 {
		w.logFailures("G4 download", downloads, errs)
	}
	if errs := w.runOps(staging); countErrs(errs) > 0 {
		w.logFailures("staging load", staging, errs)
	}
	errs := w.runOps(direct)
	for i, err := range errs {
		if err != nil {
			failed = append(failed, direct[i].DstBlock)
		}
	}
	if len(failed) > 0 {
		w.logFailures("load", direct, errs)
	}
	return failed
}

// WaitForSave runs the bound step's Moves (G2→G3) and then its Saves (G1→G2,
// or G1→G3 in disk-only mode), and returns when they are done. A failed copy
// leaves its destination invalid (a later load of it fails); it is logged,
// not returned: the engine must keep running.
func (w *Worker) WaitForSave() {
	w.exec.Lock()
	defer w.exec.Unlock()
	w.mu.Lock()
	s := w.step
	if s == nil || w.savesRun || w.closed {
		w.mu.Unlock()
		return
	}
	w.savesRun = true
	w.saves.Add(1)
	w.mu.Unlock()
	defer w.saves.Done()
	if len(s.Saves) > 0 {
		w.fence("save")
	}
	if errs := w.runOps(s.Moves); countErrs(errs) > 0 {
		w.logFailures("move", s.Moves, errs)
	}
	if errs := w.runOps(s.Saves); countErrs(errs) > 0 {
		w.logFailures("save", s.Saves, errs)
	}
	w.queueUploads(s.Uploads)
	w.mu.Lock()
	if s.Seq > w.savedSeq {
		w.savedSeq = s.Seq
		w.saved.Broadcast()
	}
	w.mu.Unlock()
}

// Run executes a step outside the engine's per-step calls: an operation the
// leader sent over the side channel (G2→G3 moves) rather than inside the
// engine's connector metadata. It runs the step's Drops, Loads
// (synchronously: copies into G2 first, then into G1), Moves and Saves, and
// returns the G1 blocks whose loads failed. Its results never reach Finished,
// and it neither binds the step nor touches the bound one, so the engine's
// own sequence (Bind → StartLoad → WaitForSave → Finished) is unaffected.
//
// Ordering:
//
//   - s.Seq > 0 names the engine step this operation must follow: Run first
//     waits until this worker finished the Moves/Saves of the bound step with
//     that Seq (or a later one). The leader plans a background G2→G3 move as
//     soon as the source's save is planned, which may be before this rank
//     has run that save; copying earlier would copy the block's previous
//     contents. The wait ends early (with an error) when the worker closes.
//     s.Seq == 0: no wait.
//   - Then Run holds the worker's execution lock for the rest of its
//     duration, and Bind, StartLoad (until its loads are launched) and
//     WaitForSave take the same lock, so a Run happens entirely before or
//     entirely after each of them. It may overlap only the engine's
//     asynchronous loads launched by an earlier StartLoad, which is safe
//     because the leader never hands a block that a running load reads or
//     writes to another operation (load sources stay pinned until the engine
//     reports the load finished). A Run may delay the engine's WaitForSave
//     by its own duration, so background operations should stay small.
//
// err is non-nil when the step could not run (worker closed, KV caches not
// registered) or when any of its Moves or Saves failed: their destinations
// hold no valid bytes on this rank, so the leader must not register them.
// Failed loads are reported through loadErrors only.
func (w *Worker) Run(s *plan.Step) (loadErrors []int64, err error) {
	if s == nil {
		return nil, errors.New("run step: nil step")
	}
	w.mu.Lock()
	for s.Seq > w.savedSeq && !w.closed {
		w.saved.Wait()
	}
	w.mu.Unlock()

	w.exec.Lock()
	defer w.exec.Unlock()
	w.mu.Lock()
	switch {
	case w.closed:
		w.mu.Unlock()
		return nil, fmt.Errorf("worker rank %d: run step: worker is closed", w.opts.Rank)
	case w.g1 == nil:
		w.mu.Unlock()
		return nil, fmt.Errorf("worker rank %d: run step: KV caches not registered yet", w.opts.Rank)
	}
	w.saves.Add(1) // Close waits for it before unmapping the regions
	w.mu.Unlock()
	defer w.saves.Done()

	w.applyDrops(s.Drops)
	w.stageTags(s)
	if len(s.Loads) > 0 {
		w.fence("load")
		loadErrors = w.execLoads(s.Loads)
	}
	if len(s.Saves) > 0 {
		w.fence("save")
	}
	var failed []error
	if errs := w.runOps(s.Moves); countErrs(errs) > 0 {
		w.logFailures("move", s.Moves, errs)
		failed = append(failed, fmt.Errorf("%d of %d moves failed: %w", countErrs(errs), len(s.Moves), firstErr(errs)))
	}
	if errs := w.runOps(s.Saves); countErrs(errs) > 0 {
		w.logFailures("save", s.Saves, errs)
		failed = append(failed, fmt.Errorf("%d of %d saves failed: %w", countErrs(errs), len(s.Saves), firstErr(errs)))
	}
	w.queueUploads(s.Uploads)
	if len(failed) > 0 {
		return loadErrors, fmt.Errorf("worker rank %d: run step: %w", w.opts.Rank, errors.Join(failed...))
	}
	return loadErrors, nil
}

func firstErr(errs []error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// Finished returns the requests whose loads completed since the last call,
// and the G1 blocks among them whose data could not be loaded (the engine
// must recompute those). A request appears in loaded even if some of its
// blocks failed.
func (w *Worker) Finished() (loaded []string, loadErrorG1Blocks []int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	loaded, loadErrorG1Blocks = w.loaded, w.loadErrs
	w.loaded, w.loadErrs = nil, nil
	return loaded, loadErrorG1Blocks
}

// WaitLoads blocks until every started load has completed.
func (w *Worker) WaitLoads() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.waitLoadsLocked()
}

// Close waits for in-flight loads, then releases the host region and removes
// the disk file. The engine's tensors are untouched.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	w.saved.Broadcast() // a Run waiting for a step's saves gives up
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

// fence orders the G1 copier after the engine's submitted work. A failure
// is logged; the copies still run (their own errors are reported per block).
func (w *Worker) fence(what string) {
	if w.opts.G1 == nil {
		return
	}
	if err := w.opts.G1.Fence(); err != nil {
		w.log.Warn("kvbm worker: could not order "+what+" copies after the engine's work", "err", err)
	}
}

func countErrs(errs []error) int {
	n := 0
	for _, e := range errs {
		if e != nil {
			n++
		}
	}
	return n
}

// logFailures writes one line per phase, not one per block: a dead disk
// would otherwise flood the engine's log.
func (w *Worker) logFailures(what string, ops []plan.Copy, errs []error) {
	var first error
	var firstOp plan.Copy
	for i, e := range errs {
		if e != nil {
			first, firstOp = e, ops[i]
			break
		}
	}
	w.log.Warn("kvbm worker: "+what+" copies failed", "failed", countErrs(errs), "of", len(ops),
		"first", fmt.Sprintf("%v[%d]→%v[%d]", firstOp.Src, firstOp.SrcBlock, firstOp.Dst, firstOp.DstBlock), "err", first)
}

// direction names a copy's direction for the metrics label.
func direction(c plan.Copy) string {
	return strings.ToLower(c.Src.String() + "_to_" + c.Dst.String())
}

// runOps executes ops in batches of at most BatchSize blocks, each batch one
// direction, with at most MaxConcurrent batches in flight. errs[i] is op i's result.
func (w *Worker) runOps(ops []plan.Copy) []error {
	errs := make([]error, len(ops))
	if len(ops) == 0 {
		return errs
	}
	order := make([]int, len(ops))
	for i := range order {
		order[i] = i
	}
	key := func(c plan.Copy) int { return int(c.Src)*16 + int(c.Dst) }
	// Within one direction, order by the block whose placement matters:
	// the G1 block (neighbouring engine memory, see transfer.GatherBlocks),
	// else the disk block (sequential file offsets).
	locality := func(c plan.Copy) int64 {
		switch {
		case c.Src == plan.G1:
			return c.SrcBlock
		case c.Dst == plan.G1, c.Dst == plan.G3:
			return c.DstBlock
		}
		return c.SrcBlock
	}
	slices.SortStableFunc(order, func(a, b int) int {
		if d := key(ops[a]) - key(ops[b]); d != 0 {
			return d
		}
		return cmp.Compare(locality(ops[a]), locality(ops[b]))
	})
	type batch struct{ lo, hi int } // range of order
	var batches []batch
	for lo := 0; lo < len(order); {
		hi := lo + 1
		limit := w.batchLimit(ops[order[lo]])
		for hi < len(order) && hi-lo < limit && key(ops[order[hi]]) == key(ops[order[lo]]) {
			hi++
		}
		batches = append(batches, batch{lo, hi})
		lo = hi
	}
	// Memory batches and disk batches run under their own limits, side by side.
	var memB, diskB []batch
	for _, b := range batches {
		if c := ops[order[b.lo]]; c.Src == plan.G3 || c.Dst == plan.G3 {
			diskB = append(diskB, b)
		} else {
			memB = append(memB, b)
		}
	}
	run := func(bs []batch) func(slot, bi, _ int) {
		return func(slot, bi, _ int) {
			b := bs[bi]
			dir := direction(ops[order[b.lo]])
			start := time.Now()
			var moved int64
			idx := order[b.lo:b.hi]
			if c := ops[idx[0]]; (c.Src == plan.G1 && c.Dst == plan.G2) || (c.Src == plan.G2 && c.Dst == plan.G1) {
				w.copyMemBatch(ops, idx, errs)
			} else {
				for _, i := range idx {
					errs[i] = w.copyOne(ops[i], slot)
				}
			}
			for _, i := range idx {
				if errs[i] == nil {
					moved += w.bpb
				}
			}
			w.m.TransferSecs.WithLabelValues(dir).Observe(time.Since(start).Seconds())
			if moved > 0 {
				w.m.BytesMoved.WithLabelValues(dir).Add(float64(moved))
			}
		}
	}
	var wg sync.WaitGroup
	if len(diskB) > 0 {
		wg.Add(1)
		go func() { // joined below, before runOps returns
			defer wg.Done()
			w.diskLim.Run(len(diskB), 1, run(diskB))
		}()
	}
	w.lim.Run(len(memB), 1, run(memB))
	wg.Wait()
	return errs
}

// batchLimit is the most blocks one batch of c's direction carries.
func (w *Worker) batchLimit(c plan.Copy) int {
	if c.Src == plan.G1 || c.Dst == plan.G1 {
		if g := w.opts.G1; g != nil && g.MaxBatch() > 0 {
			return g.MaxBatch()
		}
	}
	return w.opts.BatchSize
}

// gather and scatter move one set of G1 blocks through the configured copier.
func (w *Worker) gather(blocks []int, dsts [][]byte) error {
	if w.opts.G1 != nil {
		return w.opts.G1.GatherBlocks(blocks, dsts)
	}
	transfer.GatherBlocks(w.g1, blocks, dsts)
	return nil
}

func (w *Worker) scatter(blocks []int, srcs [][]byte) error {
	if w.opts.G1 != nil {
		return w.opts.G1.ScatterBlocks(blocks, srcs)
	}
	transfer.ScatterBlocks(w.g1, blocks, srcs)
	return nil
}

func (w *Worker) checkBlock(t plan.Tier, b int64) error {
	var n int
	switch t {
	case plan.G1:
		n = w.g1.NumBlocks
	case plan.G2:
		if w.host == nil {
			return fmt.Errorf("%v: %w", t, ErrNoTier)
		}
		n = w.host.NumBlocks()
	case plan.G3:
		if w.disk == nil {
			return fmt.Errorf("%v: %w", t, ErrNoTier)
		}
		n = len(w.diskValid)
	default:
		return fmt.Errorf("unknown tier %v", t)
	}
	if b < 0 || b >= int64(n) {
		return fmt.Errorf("%v block %d out of range [0, %d)", t, b, n)
	}
	return nil
}

// copyMemBatch runs one batch of G1→G2 or G2→G1 copies as a single chunk
// walk over all its blocks (transfer.GatherBlocks / ScatterBlocks).
func (w *Worker) copyMemBatch(ops []plan.Copy, idx []int, errs []error) {
	toHost := ops[idx[0]].Src == plan.G1
	g1s := make([]int, 0, len(idx))
	bufs := make([][]byte, 0, len(idx))
	live := make([]int, 0, len(idx))
	for _, i := range idx {
		c := ops[i]
		if err := w.checkBlock(c.Src, c.SrcBlock); err != nil {
			errs[i] = fmt.Errorf("copy source: %w", err)
			continue
		}
		if err := w.checkBlock(c.Dst, c.DstBlock); err != nil {
			errs[i] = fmt.Errorf("copy destination: %w", err)
			continue
		}
		if toHost {
			w.hostValid[c.DstBlock].Store(false)
			g1s, bufs = append(g1s, int(c.SrcBlock)), append(bufs, w.host.Block(int(c.DstBlock)))
		} else {
			if !w.hostValid[c.SrcBlock].Load() {
				errs[i] = fmt.Errorf("G2 block %d: %w", c.SrcBlock, ErrNotValid)
				continue
			}
			g1s, bufs = append(g1s, int(c.DstBlock)), append(bufs, w.host.Block(int(c.SrcBlock)))
		}
		live = append(live, i)
	}
	defer func() {
		if r := recover(); r != nil {
			err := fmt.Errorf("internal error in a batch of %d copies: %v", len(live), r)
			w.log.Error("kvbm worker: recovered from a panic in a copy batch", "err", err)
			for _, i := range live {
				errs[i] = err
			}
		}
	}()
	if toHost {
		if err := w.gather(g1s, bufs); err != nil {
			for _, i := range live {
				errs[i] = err
			}
			return
		}
		for _, i := range live {
			w.hostValid[ops[i].DstBlock].Store(true)
		}
	} else if err := w.scatter(g1s, bufs); err != nil {
		for _, i := range live {
			errs[i] = err
		}
	}
}

// copyOne moves one block. slot owns bounce block `slot` for G1↔G3 copies.
// A panic (a bug, never expected) fails the copy instead of the engine process.
func (w *Worker) copyOne(c plan.Copy, slot int) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("internal error copying %v[%d]→%v[%d]: %v", c.Src, c.SrcBlock, c.Dst, c.DstBlock, r)
			w.log.Error("kvbm worker: recovered from a panic in a copy", "err", err)
		}
	}()
	if err := w.checkBlock(c.Src, c.SrcBlock); err != nil {
		return fmt.Errorf("copy source: %w", err)
	}
	if err := w.checkBlock(c.Dst, c.DstBlock); err != nil {
		return fmt.Errorf("copy destination: %w", err)
	}
	src, dst := int(c.SrcBlock), int(c.DstBlock)
	switch {
	case c.Src == plan.G1 && c.Dst == plan.G2:
		w.hostValid[dst].Store(false)
		if err := w.gather([]int{src}, [][]byte{w.host.Block(dst)}); err != nil {
			return err
		}
		w.hostValid[dst].Store(true)
		return nil

	case c.Src == plan.G2 && c.Dst == plan.G1:
		if !w.hostValid[src].Load() {
			return fmt.Errorf("G2 block %d: %w", src, ErrNotValid)
		}
		return w.scatter([]int{dst}, [][]byte{w.host.Block(src)})

	case c.Src == plan.G1 && c.Dst == plan.G3:
		buf := w.bounce.IOBlock(slot)
		if err := w.gather([]int{src}, [][]byte{buf[:w.bpb]}); err != nil {
			return err
		}
		return w.writeDisk(dst, buf)

	case c.Src == plan.G2 && c.Dst == plan.G3:
		if !w.hostValid[src].Load() {
			w.diskValid[dst].Store(false)
			return fmt.Errorf("G2 block %d: %w", src, ErrNotValid)
		}
		return w.writeDisk(dst, w.host.IOBlock(src))

	case c.Src == plan.G3 && c.Dst == plan.G1:
		buf := w.bounce.IOBlock(slot)
		if err := w.readDisk(src, buf); err != nil {
			return err
		}
		return w.scatter([]int{dst}, [][]byte{buf[:w.bpb]})

	case c.Src == plan.G3 && c.Dst == plan.G2:
		w.hostValid[dst].Store(false)
		if err := w.readDisk(src, w.host.IOBlock(dst)); err != nil {
			return err
		}
		w.hostValid[dst].Store(true)
		return nil
	}
	return fmt.Errorf("unsupported copy %v → %v", c.Src, c.Dst)
}

// writeDisk writes buf (an aligned IO block whose payload is the first bpb
// bytes) to G3 block dst and records its checksum.
func (w *Worker) writeDisk(dst int, buf []byte) error {
	w.diskValid[dst].Store(false)
	if w.degraded.Load() {
		return fmt.Errorf("G3 block %d: %w", dst, ErrDiskDegraded)
	}
	sum := xxh3.Hash(buf[:w.bpb])
	if err := w.writeDiskBlock(dst, buf, sum); err != nil {
		w.degrade(err)
		return err
	}
	w.diskSum[dst].Store(sum)
	w.diskValid[dst].Store(true)
	return nil
}

// readDisk reads G3 block src into buf and verifies it. A block that does not
// verify is forgotten, so it is never served again.
func (w *Worker) readDisk(src int, buf []byte) error {
	if w.degraded.Load() {
		return fmt.Errorf("G3 block %d: %w", src, ErrDiskDegraded)
	}
	if !w.diskValid[src].Load() {
		return fmt.Errorf("G3 block %d: %w", src, ErrNotValid)
	}
	if err := w.disk.ReadBlock(src, buf); err != nil {
		w.degrade(err)
		return err
	}
	if got, want := xxh3.Hash(buf[:w.bpb]), w.diskSum[src].Load(); got != want {
		w.diskValid[src].Store(false)
		w.forgetOnDisk(src)
		return fmt.Errorf("G3 block %d: %w (stored %016x, read %016x)", src, ErrChecksum, want, got)
	}
	return nil
}

// degrade switches the disk tier off after its first I/O error and says so once.
func (w *Worker) degrade(err error) {
	if w.degraded.CompareAndSwap(false, true) {
		w.log.Error("kvbm disk tier failed; continuing without it (G3 loads fail and are recomputed, G2→G3 offload stops)",
			"path", w.DiskPath(), "err", err)
	}
}
