package pagestore

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports the counters of page stores (kvbm_pagestore_*, one
// series per store, labelled by its pool) on kvbm's metrics endpoint. Stores
// are added when they open and removed when they close.
type Collector struct {
	mu     sync.Mutex
	stores map[string]*Store
}

// NewCollector returns an empty collector.
func NewCollector() *Collector { return &Collector{stores: map[string]*Store{}} }

// Add exports s under label pool (a later store of the same label replaces it).
func (c *Collector) Add(pool string, s *Store) {
	c.mu.Lock()
	c.stores[pool] = s
	c.mu.Unlock()
}

// Remove stops exporting s (if it is still the store of its label).
func (c *Collector) Remove(pool string, s *Store) {
	c.mu.Lock()
	if c.stores[pool] == s {
		delete(c.stores, pool)
	}
	c.mu.Unlock()
}

type metricDesc struct {
	d     *prometheus.Desc
	kind  prometheus.ValueType
	value func(*Stats) float64
}

func desc(name, help string, kind prometheus.ValueType, value func(*Stats) float64) metricDesc {
	return metricDesc{prometheus.NewDesc(name, help, []string{"pool"}, nil), kind, value}
}

var pagestoreMetrics = []metricDesc{
	desc("kvbm_pagestore_pages", "Page slots of the page store's disk tier file", prometheus.GaugeValue,
		func(s *Stats) float64 { return float64(s.NumPages) }),
	desc("kvbm_pagestore_pages_used", "Pages the page store holds on disk", prometheus.GaugeValue,
		func(s *Stats) float64 { return float64(s.Used) }),
	desc("kvbm_pagestore_page_bytes", "Bytes of one page", prometheus.GaugeValue,
		func(s *Stats) float64 { return float64(s.PageBytes) }),
	desc("kvbm_pagestore_recovered_pages", "Pages recovered from a persistent tier file at start", prometheus.GaugeValue,
		func(s *Stats) float64 { return float64(s.Recovered) }),
	desc("kvbm_pagestore_puts", "Pages written to the disk tier", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.Puts) }),
	desc("kvbm_pagestore_put_duplicates", "Pages put that the store held already (kept as they were)",
		prometheus.CounterValue, func(s *Stats) float64 { return float64(s.PutDuplicates) }),
	desc("kvbm_pagestore_put_failures", "Pages that could not be written (no free slot, I/O error)",
		prometheus.CounterValue, func(s *Stats) float64 { return float64(s.PutFailures) }),
	desc("kvbm_pagestore_hits", "Pages read from the disk tier", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.Hits) }),
	desc("kvbm_pagestore_misses", "Pages asked for and not held (the engine recomputes them)", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.Misses) }),
	desc("kvbm_pagestore_corrupt", "Pages that failed their checksum or MAC at read (dropped, reported missing)",
		prometheus.CounterValue, func(s *Stats) float64 { return float64(s.Corrupt) }),
	desc("kvbm_pagestore_evictions", "Pages evicted (least recently used) to make room", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.Evictions) }),
	desc("kvbm_pagestore_object_hits", "Pages read from the object tier (G4)", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.ObjectHits) }),
	desc("kvbm_pagestore_object_uploads", "Pages queued for upload to the object tier (G4)", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.ObjectUploads) }),
	desc("kvbm_pagestore_bytes_written", "Bytes written to the disk tier", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.BytesWritten) }),
	desc("kvbm_pagestore_bytes_read", "Bytes read from the disk and object tiers", prometheus.CounterValue,
		func(s *Stats) float64 { return float64(s.BytesRead) }),
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range pagestoreMetrics {
		ch <- m.d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	stores := make(map[string]*Store, len(c.stores))
	for k, v := range c.stores {
		stores[k] = v
	}
	c.mu.Unlock()
	for pool, s := range stores {
		st := s.Stats()
		for _, m := range pagestoreMetrics {
			ch <- prometheus.MustNewConstMetric(m.d, m.kind, m.value(&st), pool)
		}
	}
}
