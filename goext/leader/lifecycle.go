package leader

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
)

// Expiry (design §12): G3 blocks registered longer ago than
// DYN_KVBM_DISK_TTL_SECS and G4 objects older than DYN_KVBM_OBJECT_TTL_SECS
// are removed by a sweeper goroutine whose every pass is bounded: at most
// DiskSweepSlots block slots of the G3 pool (under the leader's lock) and
// one listing of at most ObjectSweepObjects objects (off the lock). A
// persistent G3 tier's blocks keep their write time across restarts, and
// RestoreDisk skips those already expired.

// Bounds of one sweeper pass, and how often passes run.
const (
	DiskSweepSlots      = 4096
	ObjectSweepObjects  = 1000
	DiskSweepInterval   = time.Second
	ObjectSweepInterval = 10 * time.Second
)

type lifecycle struct {
	diskTTL, objTTL time.Duration
	tombs           *tombstones // nil: no persistent G3 tier

	diskCursor int    // next G3 slot to examine (l.mu)
	objCursor  string // next object key to list after (sweeper goroutine only)

	purges         atomic.Uint64
	expiredDisk    atomic.Uint64
	expiredObjects atomic.Uint64
	objectErrors   atomic.Uint64

	cancel context.CancelFunc // stops the sweeper; nil when none runs
	done   chan struct{}

	// Re-checks of salt purges (purge.go): bg ends them at Close.
	bg       context.Context
	bgCancel context.CancelFunc
	bgWG     sync.WaitGroup
}

// newLifecycle reads the TTLs; the sweeper starts in startLifecycle.
func newLifecycle(cfg *config.Config, persistentDisk bool) *lifecycle {
	lc := &lifecycle{diskTTL: cfg.Lifecycle.DiskTTL, objTTL: cfg.Lifecycle.ObjectTTL}
	lc.bg, lc.bgCancel = context.WithCancel(context.Background())
	if persistentDisk {
		lc.tombs = newTombstones(cfg.DiskCacheDir)
	}
	return lc
}

// startLifecycle starts the sweeper when a TTL applies to a configured tier.
func (l *Leader) startLifecycle() {
	lc := l.life
	disk := lc.diskTTL > 0 && l.disk != nil
	obj := lc.objTTL > 0 && l.g4 != nil
	if !disk && !obj {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	lc.cancel, lc.done = cancel, make(chan struct{})
	go func() {
		defer close(lc.done)
		tick := time.NewTicker(DiskSweepInterval)
		defer tick.Stop()
		var lastObj time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if disk {
				l.SweepDisk()
			}
			if obj && time.Since(lastObj) >= ObjectSweepInterval {
				lastObj = time.Now()
				l.SweepObjects(ctx)
			}
		}
	}()
}

// stopLifecycle stops the sweeper and waits for it.
func (l *Leader) stopLifecycle() {
	l.life.bgCancel()
	l.life.bgWG.Wait()
	if lc := l.life; lc.cancel != nil {
		lc.cancel()
		<-lc.done
		lc.cancel = nil
	}
}

// SweepDisk is one bounded expiry pass over the G3 pool: it examines
// DiskSweepSlots slots after the last pass's and forgets the blocks
// registered more than DYN_KVBM_DISK_TTL_SECS ago (REMOVE events; the
// workers drop them in the next step). It returns how many it forgot.
func (l *Leader) SweepDisk() int {
	if l.life.diskTTL <= 0 || l.disk == nil {
		return 0
	}
	l.mu.Lock()
	defer l.unlock()
	cutoff := l.now().Add(-l.life.diskTTL).UnixNano()
	var expired []int
	expired, l.life.diskCursor = l.disk.Expired(cutoff, l.life.diskCursor, DiskSweepSlots, l.idxBuf[:0])
	for _, idx := range expired {
		l.disk.Invalidate(l.disk.Info(idx).SeqHash)
		l.dropIfFree(l.disk, idx)
	}
	if len(expired) > 0 {
		l.gen++
		l.updateGauges()
		l.life.expiredDisk.Add(uint64(len(expired)))
		l.m.ExpiredBlocks.WithLabelValues("g3").Add(float64(len(expired)))
	}
	return len(expired)
}

// SweepObjects is one bounded expiry pass over the bucket: it lists at
// most ObjectSweepObjects kvbm objects after the last pass's and deletes
// those older than DYN_KVBM_OBJECT_TTL_SECS. Nothing happens until rank 0's
// store is known or while it is unavailable.
func (l *Leader) SweepObjects(ctx context.Context) object.PurgeResult {
	if l.life.objTTL <= 0 || l.g4 == nil {
		return object.PurgeResult{}
	}
	l.mu.Lock()
	store := l.g4.opts.Store
	l.unlock()
	if store == nil || !store.Ready() || !store.Available() {
		return object.PurgeResult{}
	}
	next, res, err := store.Sweep(ctx, l.now(), l.life.objTTL, ObjectSweepObjects, l.life.objCursor)
	l.life.objCursor = next
	l.life.expiredObjects.Add(uint64(res.Deleted))
	if res.Deleted > 0 {
		l.m.ExpiredBlocks.WithLabelValues("g4").Add(float64(res.Deleted))
	}
	if err != nil {
		l.life.objectErrors.Add(1)
		l.log.Debug("kvbm G4 expiry pass failed", "err", err)
	}
	return res
}

// restoreFilter returns which recovered blocks a restore must skip because
// a purge removed them (tombstones) or they expired, and the tombstones to
// keep. The skipped blocks are dropped in the first step. l.mu held.
func (l *Leader) restoreFilter(blocks []RecoveredBlock, st *RestoreStats) []RecoveredBlock {
	tombs, err := l.life.tombs.load()
	if err != nil {
		l.log.Warn("kvbm leader: could not read the purged disk blocks; every recovered block is dropped", "err", err)
	}
	var cutoff int64
	if l.life.diskTTL > 0 {
		cutoff = l.now().Add(-l.life.diskTTL).UnixNano()
	}
	var keep []tombstone
	out := blocks[:0]
	for _, b := range blocks {
		t := tombstone{block: b.Block, hash: b.SeqHash}
		_, purged := tombs[t]
		switch {
		case err != nil || purged:
			st.Skipped[SkipPurged]++
			keep = append(keep, t)
		case cutoff != 0 && b.WrittenAt < cutoff:
			st.Skipped[SkipExpired]++
		default:
			out = append(out, b)
			continue
		}
		l.drops[tierBlock{plan.G3, int(b.Block)}] = struct{}{}
	}
	if err == nil {
		if werr := l.life.tombs.rewrite(keep); werr != nil {
			l.log.Warn("kvbm leader: could not compact the purged disk blocks", "err", werr)
		}
	}
	return out
}

// Reasons RestoreDisk skips a recovered block, beyond those of recover.go.
const (
	SkipPurged  = "purged"  // a purge removed it (tombstones)
	SkipExpired = "expired" // older than DYN_KVBM_DISK_TTL_SECS
)

// LifecycleStats are the purge and expiry counters.
type LifecycleStats struct {
	Purges         uint64 `json:"purges"`
	ExpiredDisk    uint64 `json:"expired_disk_blocks"`
	ExpiredObjects uint64 `json:"expired_objects"`
	ObjectErrors   uint64 `json:"object_sweep_errors"`
	DiskTTLSecs    int64  `json:"disk_ttl_secs"`
	ObjectTTLSecs  int64  `json:"object_ttl_secs"`
}

// Stats is what `python -m kvbm stats` shows: tier occupancy, hit rates,
// G4 registry size, purge and expiry counters.
type Stats struct {
	BlockSize      int            `json:"block_size"`
	HostBlocks     int            `json:"host_blocks"`
	HostRegistered int            `json:"host_registered"`
	DiskBlocks     int            `json:"disk_blocks"`
	DiskRegistered int            `json:"disk_registered"`
	DiskPersistent bool           `json:"disk_persistent"`
	HostHitRate    float64        `json:"host_hit_rate"`
	DiskHitRate    float64        `json:"disk_hit_rate"`
	G4             bool           `json:"g4"`
	G4Registered   int            `json:"g4_registered"`
	G4Purged       uint64         `json:"g4_objects_deleted"`
	Requests       int            `json:"requests"`
	Lifecycle      LifecycleStats `json:"lifecycle"`
}

// Stats returns a snapshot.
func (l *Leader) Stats() Stats {
	l.mu.Lock()
	defer l.unlock()
	s := Stats{BlockSize: l.bs, DiskPersistent: l.tagSteps(), Requests: len(l.slots), G4: l.g4 != nil,
		G4Purged: object.Purged()}
	if l.host != nil {
		s.HostBlocks, s.HostRegistered = l.host.Capacity(), l.host.NumRegistered()
	}
	if l.disk != nil {
		s.DiskBlocks, s.DiskRegistered = l.disk.Capacity(), l.disk.NumRegistered()
	}
	s.HostHitRate, s.DiskHitRate = l.hits.rates()
	if l.g4 != nil {
		s.G4Registered = l.g4.reg.Len()
	}
	lc := l.life
	s.Lifecycle = LifecycleStats{Purges: lc.purges.Load(), ExpiredDisk: lc.expiredDisk.Load(),
		ExpiredObjects: lc.expiredObjects.Load(), ObjectErrors: lc.objectErrors.Load(),
		DiskTTLSecs: int64(lc.diskTTL / time.Second), ObjectTTLSecs: int64(lc.objTTL / time.Second)}
	return s
}
