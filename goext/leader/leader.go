// Package leader is kvbm's scheduler-side brain (design §2, §4): one per engine
// instance, in the engine's scheduler process. It owns the logical G2 (host)
// and G3 (disk) pools, one slot per request, the external matching rule,
// onboard planning into the engine's G1 blocks, write-through offload
// planning, the G2→G3 queue with its frequency filter, cache statistics and
// metrics. It never touches bytes: each engine step it hands the workers a
// plan.Step, and workers execute it in order.
//
// The API is engine independent. The Python adapters turn vLLM / TensorRT-LLM
// objects into these calls:
//
//	GetNumNewMatchedTokens  ← get_num_new_matched_tokens
//	UpdateStateAfterAlloc   ← update_state_after_alloc
//	Step                    ← build_connector_meta (the encoded plan.Step)
//	RequestFinished         ← request_finished
//	LoadsFinished/LoadErrors← what workers reported (finished loading, failed G1 blocks)
//	ResetCache              ← reset_cache
//
// Timing model the planning relies on (see plan's package comment): a worker
// executes step N's Loads, then Moves, then Saves, and finishes step N before
// step N+1. So a block is registered when its copy is planned (it is readable
// by any later step), a block saved in step N is moved to disk in step N+1 at
// the earliest, and a block written or read by step N's Moves/Saves is pinned
// only while step N is being planned. Load sources stay pinned until the
// engine reports the load finished (loads may complete asynchronously).
//
// All methods are safe for concurrent use (one mutex; the engine calls them
// from its scheduler thread, so there is no contention in practice).
package leader

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/pool"
)

// Options configure a Leader.
type Options struct {
	Config *config.Config
	// BlockSize is the engine's block size in tokens.
	BlockSize int
	// BytesPerBlock is one worker's share of one block (design §2), as reported
	// by the workers; NumWorkers is how many there are (tensor parallel size).
	BytesPerBlock int64
	NumWorkers    int
	// Sink receives G2/G3 registrations and evictions; nil discards them.
	Sink events.Sink
	// Metrics receives design §9 counters and gauges; nil: a private set.
	Metrics *metrics.Metrics
	// Logger; nil: slog.Default().
	Logger *slog.Logger
	// WorkerID names this engine instance in the periodic cache log line.
	WorkerID uint64
	// Now is the clock (frequency-filter decay, log interval); nil: time.Now.
	// Tests inject a fake one.
	Now func() time.Time
	// MaxMovesPerStep caps the G2→G3 copies planned per step so one huge
	// prefill does not stall a single step on disk writes; the rest wait in
	// the queue. 0: no cap. It also caps one background operation (0 there:
	// 256 moves).
	MaxMovesPerStep int
	// Background: G2→G3 moves are not planned into Step but handed out by
	// PlanBackground and registered by CommitBackground once every worker
	// executed them (tensor parallelism over the side channel; see
	// background.go). Default off: moves ride in the step plans.
	Background bool
	// SideChannel, when set, is the side channel to the tensor-parallel
	// ranks: the leader runs its background operations over it in its own
	// goroutine (sidechannel.go) and Background is implied. Close stops it.
	SideChannel Broadcaster
	// BroadcastTimeout bounds one background operation; 0:
	// DefaultBroadcastTimeout.
	BroadcastTimeout time.Duration
	// G4 enables the object-storage tier (g4.go); nil: none. Needs G2.
	G4 *G4Options
	// LoadFullHit: when every block of a prompt that ends on a block
	// boundary is cached, load all of them and report one token fewer than
	// the prompt; the engine recomputes only the last token over the loaded
	// KV (the same values, written again) so it can sample the next one.
	// vLLM accepts such a hit (its scheduler keeps at least one token to
	// compute). Off (TensorRT-LLM, whose matches are whole blocks), the last
	// block is left to the engine: a full hit then recomputes a whole block.
	LoadFullHit bool
	// Groups: the engine's KV cache groups, when its plans carry group rows
	// (several groups, or one that frees blocks before its window); nil
	// otherwise (groups.go).
	Groups *Groups
	// ObserveTransfers feeds the load-cost model with the timed batches of
	// the workers that share this process (policy.ReportTransfer); off, it
	// keeps its priors (tests with several leaders in one process).
	ObserveTransfers bool
}

// Leader is one engine instance's block manager. See the package comment.
type Leader struct {
	// Set by New and never reassigned; read without mu. The pools, the
	// filter, the hit window and the G4 state they point to are guarded by
	// mu; the side-channel loop (sc) has its own lock.
	bs       int
	host     *pool.Pool // G2; nil when not configured
	disk     *pool.Pool // G3; nil when not configured
	saveTo   *pool.Pool // target of write-through saves: host, or disk in disk-only mode
	minPrio  int        // DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY; 0 = off
	filter   *freqFilter
	maxMoves int
	persist  bool         // DYN_KVBM_DISK_PERSIST: steps tag their G3 writes (recover.go)
	fullHit  bool         // Options.LoadFullHit
	groups   *Groups      // Options.Groups
	g4       *g4State     // nil: no G4 tier (g4.go)
	sc       *sideChannel // background loop; nil without Options.SideChannel
	life     *lifecycle   // purge tombstones and expiry (purge.go, lifecycle.go)
	hits     *hitWindow
	pol      policyState // load policy and G3/G4 admission (policy.go)
	workerID uint64
	m        *metrics.Metrics
	log      *slog.Logger
	now      func() time.Time

	// mu guards everything below; every method that touches it holds mu
	// for its whole call.
	mu sync.Mutex

	restored bool // RestoreDisk ran

	slots     map[string]*slot
	spare     []*slot                  // finished slots kept for their buffers
	planned   []*slot                  // slots with a load planned but not yet emitted, in planning order
	inflight  map[string]*inflightLoad // emitted loads whose sources are still pinned
	loadsByG1 map[int64]loadRef        // last load into each G1 block (for LoadErrors)
	moves     moveQueue
	moveSeq   uint64                 // FIFO order within a priority
	drops     map[tierBlock]struct{} // invalid blocks to announce in the next Step
	saveRetry bool                   // a save found its tier full of pinned blocks: retried next Step
	stepWord  *atomic.Int64          // follows StepNeeded (quiet.go); nil: none

	seq uint64 // last emitted plan.Step.Seq

	// Background operations and degraded mode (background.go).
	bgMode    bool
	bgNext    uint64              // last ticket handed out
	bgOps     map[uint64]*bgOp    // open tickets
	bgHashes  map[uint64]struct{} // hashes with an open ticket's G3 copy
	hostTags  []uint64            // persistent disk tier: HostTag id of each G2 block's registration, 0: none (recover.go)
	tagSeq    uint64              // last HostTag id handed out
	gen       uint64              // bumped by ResetCache
	degraded  bool
	deadRanks []int

	statsLog statsLogger
	idle     idleList // slots by last use, for aging out (idle.go)

	// Per-step scratch, reused to keep Step allocation-light.
	written []tierBlock // blocks written by this step's Moves/Saves (pinned until emitted)
	moveSrc []int       // G2 sources of this step's Moves (pinned until emitted)
	idxBuf  []int
}

type tierBlock struct {
	tier plan.Tier
	idx  int
}

// New sizes the tiers (design §2) and creates the leader.
func New(opts Options) (*Leader, error) {
	if opts.Config == nil {
		return nil, errors.New("leader: Options.Config is nil")
	}
	if opts.BlockSize < 1 {
		return nil, fmt.Errorf("leader: block size %d tokens: must be positive", opts.BlockSize)
	}
	if opts.BytesPerBlock < 1 {
		return nil, fmt.Errorf("leader: bytes_per_block %d reported by the workers: must be positive", opts.BytesPerBlock)
	}
	if opts.NumWorkers < 1 {
		return nil, fmt.Errorf("leader: %d workers: need at least one", opts.NumWorkers)
	}
	if g := opts.Groups; g != nil && (len(g.Windows) == 0 || g.Primary < 0 || g.Primary >= len(g.Windows)) {
		return nil, fmt.Errorf("leader: KV cache groups: primary group %d of %d", g.Primary, len(g.Windows))
	}
	cfg := opts.Config
	hostBlocks, diskBlocks, err := cfg.TierBlocks(opts.BytesPerBlock, opts.NumWorkers)
	if err != nil {
		return nil, fmt.Errorf("leader: %w", err)
	}
	total := opts.BytesPerBlock * int64(opts.NumWorkers)

	l := &Leader{
		bs:        opts.BlockSize,
		minPrio:   cfg.HostOffloadPrefixMinPriority,
		maxMoves:  opts.MaxMovesPerStep,
		persist:   cfg.DiskPersist,
		fullHit:   opts.LoadFullHit,
		groups:    opts.Groups,
		slots:     make(map[string]*slot),
		inflight:  make(map[string]*inflightLoad),
		loadsByG1: make(map[int64]loadRef),
		drops:     make(map[tierBlock]struct{}),
		bgMode:    opts.Background || opts.SideChannel != nil,
		bgOps:     make(map[uint64]*bgOp),
		bgHashes:  make(map[uint64]struct{}),
		hits:      newHitWindow(cfg.CacheStatsMaxRequests),
		statsLog:  statsLogger{interval: cfg.CacheStatsLogInterval},
		workerID:  opts.WorkerID,
		m:         opts.Metrics,
		log:       opts.Logger,
		now:       opts.Now,
	}
	if l.m == nil {
		l.m = metrics.New()
	}
	if l.log == nil {
		l.log = slog.Default()
	}
	if l.now == nil {
		l.now = time.Now
	}
	l.idle.timeout = cfg.LeaderRequestIdle
	l.idle.agedOut = l.m.RequestsAgedOut()
	sink := opts.Sink
	if sink == nil {
		sink = events.NopSink{}
	}
	if hostBlocks > 0 {
		l.host = pool.New(plan.G2, hostBlocks, sink, events.HolderKvbmHost)
		l.saveTo = l.host
	}
	if diskBlocks > 0 {
		l.disk = pool.New(plan.G3, diskBlocks, sink, events.HolderKvbmDisk)
		if l.host == nil {
			// Disk-only mode (design §4): write-through goes G1→G3 directly.
			l.saveTo = l.disk
		}
	}
	if l.g4 = newG4State(opts.G4); l.g4 != nil {
		if l.host == nil {
			return nil, fmt.Errorf("leader: %w", cfg.CheckObject())
		}
		l.g4.storeWait = l.now().Add(l.g4.opts.StoreWait)
	}
	l.life = newLifecycle(cfg, l.tagSteps())
	if l.disk != nil {
		l.disk.SetClock(func() int64 { return l.now().UnixNano() })
	}
	if l.host != nil && l.disk != nil && !cfg.DisableDiskOffloadFilter &&
		(cfg.Admission.Disk == "" || cfg.Admission.Disk == config.AdmitFrequency) {
		l.filter = newFreqFilter(l.now)
	}
	if err := l.initPolicy(opts); err != nil {
		return nil, err
	}
	l.m.BlockBytes.Set(float64(total))
	l.log.Info("kvbm leader sized",
		"host_blocks", hostBlocks, "disk_blocks", diskBlocks, "block_size", l.bs,
		"bytes_per_block_all_workers", total, "disk_only", l.DiskOnly(),
		"disk_offload_filter", l.filter != nil, "offload_min_priority", l.minPrio, "background_moves", l.bgMode,
		"g4", l.g4 != nil, "side_channel", opts.SideChannel != nil, "load_policy", l.pol.load.Mode.String())
	if opts.SideChannel != nil {
		l.startSideChannel(opts.SideChannel, opts.BroadcastTimeout)
	}
	l.startLifecycle()
	return l, nil
}

// NumHostBlocks is the G2 size in blocks (0 when not configured); workers
// allocate this many blocks of their own bytes_per_block.
func (l *Leader) NumHostBlocks() int {
	if l.host == nil {
		return 0
	}
	return l.host.Capacity()
}

// NumDiskBlocks is the G3 size in blocks (0 when not configured).
func (l *Leader) NumDiskBlocks() int {
	if l.disk == nil {
		return 0
	}
	return l.disk.Capacity()
}

// DiskOnly reports disk-only mode: G3 configured without G2, saves go G1→G3.
func (l *Leader) DiskOnly() bool { return l.host == nil && l.disk != nil }

// BlockSize is the engine block size in tokens.
func (l *Leader) BlockSize() int { return l.bs }

// HitRates returns the host and disk hit rates (0..1) and the block counts
// behind them, over the last CacheStatsMaxRequests finished requests.
func (l *Leader) HitRates() (host, disk float64, hostBlocks, diskBlocks, queried int) {
	l.mu.Lock()
	defer l.unlock()
	host, disk = l.hits.rates()
	return host, disk, l.hits.host, l.hits.disk, l.hits.queried
}

func (l *Leader) poolOf(t plan.Tier) *pool.Pool {
	switch t {
	case plan.G2, plan.G4: // a G4 source holds a G2 bounce block
		return l.host
	case plan.G3:
		return l.disk
	}
	return nil
}

// ResetCache forgets every G2 and G3 block (engine prefix-cache reset):
// removals are published, queued disk copies are cancelled, the frequency
// filter starts over. Blocks pinned by a staged or running load keep their
// bytes until the load lets go, but are no longer findable.
func (l *Leader) ResetCache() {
	l.mu.Lock()
	defer l.unlock()
	for _, p := range []*pool.Pool{l.host, l.disk} {
		if p == nil {
			continue
		}
		l.idxBuf = p.InvalidateAll(l.idxBuf[:0])
		for _, idx := range l.idxBuf {
			l.dropIfFree(p, idx)
		}
	}
	l.moves.clear()
	l.gen++ // open background tickets free their blocks instead of registering
	if l.filter != nil {
		l.filter.reset()
	}
	l.resetPolicy()
	l.updateGauges()
}

// dropIfFree announces block idx of p as invalid in the next Step, if nothing
// pins it. A pinned invalidated block is still being read by a load; it goes
// back to the free list silently when released (its stale contents are never
// read again: only registered blocks are read, and registering follows a write).
// A persistent disk tier drops it at once too (dropPinned, recover.go).
func (l *Leader) dropIfFree(p *pool.Pool, idx int) {
	if p.Info(idx).State == pool.Free || l.dropPinned(p) {
		l.drops[tierBlock{p.Tier(), idx}] = struct{}{}
	}
}

func (l *Leader) updateGauges() {
	if l.host != nil {
		l.m.HostBlocksUsed.Set(float64(l.host.NumRegistered()))
	}
	if l.disk != nil {
		l.m.DiskBlocksUsed.Set(float64(l.disk.NumRegistered()))
	}
	h, d := l.hits.rates()
	l.m.HostHitRate.Set(h)
	l.m.DiskHitRate.Set(d)
}
