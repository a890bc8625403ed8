package node

import (
	"fmt"
	"strconv"
	"sync"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/pagestore"
)

// PageStoreSpec is what the engine tells the page store (goext/pagestore,
// behind SGLang's HiCache backend).
type PageStoreSpec struct {
	Identity  string // what makes two pages of one key interchangeable
	PageBytes int64
	Rank      int
	// Share is the fraction of the disk tier's size this store gets, in
	// (0, 1]; 0: all of it (SGLang's hybrid models: one store per pool).
	Share float64
	// Pool labels the store's counters on kvbm's metrics endpoint
	// (DYN_KVBM_METRICS); "": "kv".
	Pool string
	// Events, when set, receives the store's pages as disk tier events
	// (a consolidator of engine "sglang").
	Events events.Sink
}

// PageStore is a page store assembled: the store and its G4 store.
type PageStore struct {
	S       *pagestore.Store
	closers undo
}

// NewPageStore opens a page store in the disk tier cfg configures, with
// the object tier when DYN_KVBM_OBJECT_* configure one. fn names the
// caller in its errors. On error what was opened is closed.
func NewPageStore(cfg *config.Config, spec PageStoreSpec, fn string, d Deps) (_ *PageStore, err error) {
	if !cfg.DiskEnabled() {
		// errprefix: the message names the caller (fn), as before the assembly moved here
		return nil, withKind(KindConfig, fmt.Errorf("%s: the disk tier is not configured: set DYN_KVBM_DISK_CACHE_GB "+
			"(or DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS); pages are stored there", fn))
	}
	pages := cfg.DiskBlocks(spec.PageBytes)
	if spec.Share > 0 {
		pages = int(float64(pages) * spec.Share)
	}
	if spec.Pool == "" {
		spec.Pool = "kv"
	}
	if pages <= 0 {
		// errprefix: the message names the caller (fn)
		return nil, withKind(KindConfig, fmt.Errorf("%s: DYN_KVBM_DISK_CACHE_GB=%g (DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS=%d) "+
			"holds no page of %d bytes for pool %s (its share %s of the size)", fn, cfg.DiskCacheGB,
			cfg.DiskCacheOverrideBlocks, spec.PageBytes, spec.Pool, strconv.FormatFloat(max(spec.Share, 0), 'g', 3, 64)))
	}
	key, err := g3Key(cfg)
	if err != nil {
		return nil, withKind(KindConfig, err)
	}
	log := d.logger()
	so := pagestore.Options{
		Dir: cfg.DiskCacheDir, NumPages: pages, PageBytes: spec.PageBytes, Identity: spec.Identity, Rank: spec.Rank,
		Persist: cfg.DiskPersist, DisableODirect: cfg.DiskDisableODirect,
		OpenDirect: cfg.DiskAllocatorType == config.DiskAllocatorOpenDirect, Key: key, Logger: log,
		Events: spec.Events,
	}
	n := &PageStore{}
	defer func() {
		if err != nil {
			n.closers.run()
		}
	}()
	if cfg.Object.Enabled {
		// The object tier (DYN_KVBM_OBJECT_*), under the store's fingerprint.
		obj, release, err := d.registry().OpenG4(cfg, pagestore.Fingerprint(spec.Identity), spec.PageBytes,
			uint64(spec.Rank), log, d.TuneStore)
		if err != nil {
			return nil, err
		}
		so.Object = obj
		so.LookupTimeout = cfg.Object.LookupTimeout
		n.closers.push(release)
	}
	s, err := pagestore.Open(so)
	if err != nil {
		return nil, withKind(KindIO, err)
	}
	n.S = s
	n.closers.push(func() { _ = s.Close() })
	if cfg.Metrics {
		reg := d.registry()
		reg.exportPageStore(cfg, spec.Rank, spec.Pool, s, d)
		n.closers.push(func() { reg.unexportPageStore(spec.Pool, s) })
	}
	return n, nil
}

// pageStoreMetrics is a process's page store metrics endpoint (Registry):
// one collector for every store of the process (one per SGLang pool),
// served on DYN_KVBM_METRICS_PORT + the first store's rank once the first
// store of a process with DYN_KVBM_METRICS on opens, until the process ends.
type pageStoreMetrics struct {
	mu     sync.Mutex
	c      *pagestore.Collector
	served bool
}

// exportPageStore adds s to the registry's page store metrics, starting
// the endpoint on first use.
func (r *Registry) exportPageStore(cfg *config.Config, rank int, pool string, s *pagestore.Store, d Deps) {
	st := &r.pageStores
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.c == nil {
		st.c = pagestore.NewCollector()
	}
	st.c.Add(pool, s)
	if st.served {
		return
	}
	st.served = true
	log := d.logger()
	m := metrics.New()
	m.Registry.MustRegister(st.c)
	port := cfg.MetricsPort + rank
	if port > 65535 {
		log.Warn("kvbm pagestore metrics endpoint not started: DYN_KVBM_METRICS_PORT + rank is past 65535",
			"port", cfg.MetricsPort, "rank", rank)
		return
	}
	c := *cfg
	c.MetricsPort = port
	srv, err := m.ServeWith(c.MetricsAddr(), metrics.ServerOptionsFrom(&c))
	if err != nil {
		log.Warn("kvbm pagestore metrics endpoint not started", "err", err)
		return
	}
	log.Info("kvbm metrics endpoint", "url", "http://"+srv.Addr+"/metrics")
}

func (r *Registry) unexportPageStore(pool string, s *pagestore.Store) {
	st := &r.pageStores
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.c != nil {
		st.c.Remove(pool, s)
	}
}

// Close closes the store, then releases its G4 store.
func (n *PageStore) Close() { n.closers.run() }
