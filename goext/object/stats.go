package object

import (
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Counters of this process's G4 activity (leader and workers together;
// Dynamo's names where Dynamo has one).
type counters struct {
	uploaded       atomic.Uint64 // kvbm_offload_blocks_h2obj
	alreadyStored  atomic.Uint64 // conditional PUT found the object (another writer)
	downloaded     atomic.Uint64 // downloads that verified
	onboarded      atomic.Uint64 // kvbm_onboard_blocks_obj2h: G4 loads planned by a leader
	lookupHits     atomic.Uint64 // kvbm_g4_lookup_hits
	lookupMisses   atomic.Uint64 // kvbm_g4_lookup_misses
	heads          atomic.Uint64 // HEAD requests sent by lookups
	dropped        atomic.Uint64 // uploads dropped: queue full or breaker open
	errors         atomic.Uint64 // failed requests (PUT, GET, HEAD)
	verifyFailures atomic.Uint64 // downloads that did not verify (damaged, forged, another key)
	corrupt        atomic.Uint64 // objects proven damaged (the same wrong bytes twice) and deleted
	purged         atomic.Uint64 // objects deleted by a purge or the expiry sweeper (purge.go)
	queued         atomic.Int64  // uploads waiting or running
	breakerOpen    atomic.Int64  // stores whose breaker is open
}

var stats counters

// Stats is a snapshot of G4 counters.
type Stats struct {
	Uploaded, AlreadyStored, Downloaded, Onboarded, LookupHits, LookupMisses, Heads uint64
	Dropped, Errors, Corrupt                                                        uint64
	VerifyFailures                                                                  uint64
	QueueDepth, BreakersOpen                                                        int64
}

func (s *Stats) add(o Stats) {
	s.Uploaded += o.Uploaded
	s.AlreadyStored += o.AlreadyStored
	s.Downloaded += o.Downloaded
	s.Onboarded += o.Onboarded
	s.LookupHits += o.LookupHits
	s.LookupMisses += o.LookupMisses
	s.Heads += o.Heads
	s.Dropped += o.Dropped
	s.Errors += o.Errors
	s.Corrupt += o.Corrupt
	s.VerifyFailures += o.VerifyFailures
	s.QueueDepth += o.QueueDepth
	s.BreakersOpen += o.BreakersOpen
}

// Local returns this process's own G4 counters.
func Local() Stats {
	return Stats{
		Uploaded: stats.uploaded.Load(), AlreadyStored: stats.alreadyStored.Load(),
		Downloaded: stats.downloaded.Load(), Onboarded: stats.onboarded.Load(), LookupHits: stats.lookupHits.Load(),
		LookupMisses: stats.lookupMisses.Load(), Heads: stats.heads.Load(), Dropped: stats.dropped.Load(), Errors: stats.errors.Load(),
		Corrupt: stats.corrupt.Load(), VerifyFailures: stats.verifyFailures.Load(), QueueDepth: stats.queued.Load(), BreakersOpen: stats.breakerOpen.Load(),
	}
}

// Workers in other processes (vLLM runs them apart from the scheduler)
// report their counters to the leader's process (SetRemote); the metrics
// endpoint there serves the sum.
var remote struct {
	mu sync.Mutex // guards m
	m  map[string]Stats
}

// SetRemote records the latest counters of another process (source names it).
func SetRemote(source string, s Stats) {
	remote.mu.Lock()
	defer remote.mu.Unlock()
	if remote.m == nil {
		remote.m = make(map[string]Stats)
	}
	remote.m[source] = s
}

// Snapshot returns this process's G4 counters plus those other processes
// reported.
func Snapshot() Stats {
	s := Local()
	remote.mu.Lock()
	defer remote.mu.Unlock()
	for _, r := range remote.m {
		s.add(r)
	}
	return s
}

// CountLookup records a G4 match: hits blocks found, misses not.
func CountLookup(hits, misses int) {
	stats.lookupHits.Add(uint64(hits))
	stats.lookupMisses.Add(uint64(misses))
}

// CountOnboard records n G4 blocks planned for loading.
func CountOnboard(n int) { stats.onboarded.Add(uint64(n)) }

// RegisterMetrics exports the G4 counters into r.
func RegisterMetrics(r prometheus.Registerer) error {
	for _, x := range []struct {
		name, help string
		get        func(Stats) float64
		gauge      bool
	}{
		{"kvbm_offload_blocks_h2obj", "Blocks uploaded from host (G2) to object storage (G4)", func(s Stats) float64 { return float64(s.Uploaded) }, false},
		{"kvbm_onboard_blocks_obj2h", "Blocks onboarded from object storage (G4) through host (G2), counted when planned (failures: kvbm_load_errors)", func(s Stats) float64 { return float64(s.Onboarded) }, false},
		{"kvbm_g4_downloads_verified", "G4 downloads that verified (header, fingerprint, checksum)", func(s Stats) float64 { return float64(s.Downloaded) }, false},
		{"kvbm_g4_lookup_hits", "Blocks matched in object storage (G4)", func(s Stats) float64 { return float64(s.LookupHits) }, false},
		{"kvbm_g4_lookup_misses", "Blocks looked up in object storage (G4) and not found", func(s Stats) float64 { return float64(s.LookupMisses) }, false},
		{"kvbm_g4_lookup_requests", "HEAD requests sent by G4 lookups", func(s Stats) float64 { return float64(s.Heads) }, false},
		{"kvbm_g4_already_stored", "Uploads skipped: the object was already stored (another instance)", func(s Stats) float64 { return float64(s.AlreadyStored) }, false},
		{"kvbm_g4_upload_drops", "Uploads dropped: queue full or store unavailable (circuit breaker open)", func(s Stats) float64 { return float64(s.Dropped) }, false},
		{"kvbm_g4_errors", "Failed object storage requests", func(s Stats) float64 { return float64(s.Errors) }, false},
		{"kvbm_g4_verify_failures", "Downloaded objects that did not verify (damaged, forged, or written under another key): misses, recomputed", func(s Stats) float64 { return float64(s.VerifyFailures) }, false},
		{"kvbm_g4_corrupt_objects", "Objects proven damaged (the same wrong bytes read twice) and deleted from the bucket", func(s Stats) float64 { return float64(s.Corrupt) }, false},
		{"kvbm_g4_upload_queue_depth", "Uploads queued or in flight", func(s Stats) float64 { return float64(s.QueueDepth) }, true},
		{"kvbm_g4_breaker_open", "Object stores currently refused by their circuit breaker", func(s Stats) float64 { return float64(s.BreakersOpen) }, true},
	} {
		get := x.get
		var c prometheus.Collector
		if x.gauge {
			c = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: x.name, Help: x.help}, func() float64 { return get(Snapshot()) })
		} else {
			c = prometheus.NewCounterFunc(prometheus.CounterOpts{Name: x.name, Help: x.help}, func() float64 { return get(Snapshot()) })
		}
		if err := r.Register(c); err != nil {
			return err
		}
	}
	return registerBucketMetrics(r)
}
