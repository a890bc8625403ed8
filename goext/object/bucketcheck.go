package object

import (
	"context"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// BucketCheck makes a store check its bucket (creating it when missing)
// off the caller's thread: opening a store never waits on the network, and
// an unreachable or blackholed endpoint costs the engine's scheduler
// nothing. A failed check is retried with exponential backoff until one
// succeeds or the store is closed. From the first failure until a check
// succeeds the store is Unavailable (a leader leaves G4 off: no matches, no
// uploads planned); before the first answer it is used as if reachable
// (that lasts one attempt, Timeout at most); once a check succeeded it stays
// Ready (later outages are the circuit breaker's business).
type BucketCheck struct {
	Region string // of a bucket created by the check
	// Timeout bounds one attempt (0: DefaultBucketCheckTimeout).
	Timeout time.Duration
	// Retry is the first wait after a failed check (0: DefaultBucketRetry);
	// each failure doubles it, up to RetryMax (0: DefaultBucketRetryMax).
	Retry, RetryMax time.Duration
}

// Defaults of BucketCheck. An attempt gets what one request's G4 lookup
// gets (the leader's default lookup deadline): a store that cannot answer
// one HEAD in that time serves no lookup either.
const (
	DefaultBucketCheckTimeout = 2 * time.Second
	DefaultBucketRetry        = 500 * time.Millisecond
	DefaultBucketRetryMax     = 30 * time.Second
)

// States of a store's bucket check.
const (
	bucketUnknown int32 = iota // first attempt running
	bucketFailed               // failed, not succeeded since: Unavailable
	bucketReady                // succeeded (or no check): Ready
)

// Counters of bucket checks in this process.
var bucketStats struct {
	unavailable atomic.Int64  // kvbm_g4_unavailable: stores Unavailable now
	failures    atomic.Uint64 // kvbm_g4_bucket_check_failures
}

// Ready reports whether the store's bucket check succeeded (always true for
// a store opened without one).
func (s *Store) Ready() bool { return s.bucket.Load() == bucketReady }

// Unavailable reports whether the bucket check failed and no check has
// succeeded since: a leader matches nothing in G4 and plans no upload
// through such a store.
func (s *Store) Unavailable() bool { return s.bucket.Load() == bucketFailed }

// startBucketCheck starts the check of o (nil: the store is ready at once).
// Called by NewStore.
func (s *Store) startBucketCheck(o *BucketCheck) {
	s.checked = make(chan struct{})
	if o == nil {
		s.bucket.Store(bucketReady)
		close(s.checked)
		return
	}
	c := *o
	if c.Timeout <= 0 {
		c.Timeout = DefaultBucketCheckTimeout
	}
	if c.Retry <= 0 {
		c.Retry = DefaultBucketRetry
	}
	if c.RetryMax <= 0 {
		c.RetryMax = DefaultBucketRetryMax
	}
	c.RetryMax = max(c.RetryMax, c.Retry)
	s.wg.Add(1)
	go s.checkBucket(c)
}

func (s *Store) checkBucket(c BucketCheck) {
	defer s.wg.Done()
	answered := false
	defer func() {
		if !answered {
			close(s.checked) // closed before the first answer
		}
		if s.bucket.Load() == bucketFailed { // closed while unavailable
			bucketStats.unavailable.Add(-1)
		}
	}()
	wait := c.Retry
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithTimeout(s.ctx, c.Timeout)
		err := s.c.EnsureBucket(ctx, c.Region)
		cancel()
		if s.ctx.Err() != nil {
			return
		}
		if err == nil {
			if s.bucket.Swap(bucketReady) == bucketFailed {
				bucketStats.unavailable.Add(-1)
			}
			if !answered {
				answered = true
				close(s.checked)
			}
			s.log.Info("kvbm G4: bucket reachable; G4 on", "bucket", s.c.Bucket(), "attempts", attempt)
			return
		}
		bucketStats.failures.Add(1)
		if attempt == 1 {
			s.bucket.Store(bucketFailed)
			bucketStats.unavailable.Add(1)
			answered = true
			close(s.checked)
			s.log.Warn("kvbm G4: bucket not reachable; G4 off until it answers (retried in the background)",
				"bucket", s.c.Bucket(), "err", err)
		} else {
			s.log.Debug("kvbm G4: bucket check failed again", "bucket", s.c.Bucket(), "attempt", attempt, "err", err)
		}
		// ±20% jitter: a fleet that lost the store together does not retry in step.
		t := time.NewTimer(time.Duration(float64(wait) * (0.8 + 0.4*rand.Float64())))
		select {
		case <-s.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, c.RetryMax)
	}
}

// awaitFirstCheck holds an upload until the bucket check's first attempt
// answered (a bucket created by the check exists by then), on an uploader
// goroutine, never the caller's: false when the store closed meanwhile.
func (s *Store) awaitFirstCheck() bool {
	select {
	case <-s.checked:
		return s.ctx.Err() == nil
	case <-s.ctx.Done():
		return false
	}
}

// registerBucketMetrics exports this process's bucket-check state.
func registerBucketMetrics(r prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvbm_g4_unavailable",
			Help: "Object stores of this process whose bucket check failed and has not succeeded since (G4 off for their leader)"},
			func() float64 { return float64(bucketStats.unavailable.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvbm_g4_bucket_check_failures",
			Help: "Failed checks of a G4 bucket at store start (retried with backoff)"},
			func() float64 { return float64(bucketStats.failures.Load()) }),
	} {
		if err := r.Register(c); err != nil {
			return err
		}
	}
	return nil
}
