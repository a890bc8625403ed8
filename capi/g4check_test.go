package main

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

// A generous bound for liveness: a call that waits on the network (a 10 s
// request timeout) or hangs exceeds it; a call that does not never comes
// near it.
const g4JoinTimeout = 5 * time.Second

// fastBucketChecks makes openG4's stores give up on a silent endpoint and
// retry quickly, for the test's duration.
func fastBucketChecks(t *testing.T) {
	old := g4StoreOptions
	g4StoreOptions = func(o *config.Object, so *object.StoreOptions) {
		old(o, so)
		so.BucketCheck.Timeout = 100 * time.Millisecond
		so.BucketCheck.Retry, so.BucketCheck.RetryMax = 10*time.Millisecond, 20*time.Millisecond
	}
	t.Cleanup(func() { g4StoreOptions = old })
}

// g4Leader starts a leader handle with G4 on addr (fp: rank 0's
// fingerprint given at start, or empty), as kvbm_leader_new does, in a
// goroutine joined with a generous timeout.
func g4Leader(t *testing.T, addr, fp string) *leaderHandle {
	t.Helper()
	cfg, err := configFor(map[string]string{
		config.EnvCPUCacheOverrideBlocks: "16",
		config.EnvObjectEnabled:          "true",
		config.EnvObjectEndpoint:         "http://" + addr,
		config.EnvObjectBucket:           "kv-capi",
		config.EnvObjectAccessKey:        s3test.AccessKey,
		config.EnvObjectSecretKey:        s3test.SecretKey,
	}, true)
	require.NoError(t, err)
	o := leaderOptions{BlockSize: 4, BytesPerBlock: 64, NumWorkers: 1, Fingerprint: fp, G4Async: true}
	h := &leaderHandle{m: metrics.New(), cfg: cfg, opts: o}
	done := make(chan error, 1)
	go func() { done <- h.start(o, cfg, nil) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(g4JoinTimeout):
		t.Fatal("kvbm_leader_new waited on the object store")
	}
	t.Cleanup(h.close)
	return h
}

// g4Gauge reads kvbm_g4_unavailable from the leader's metrics.
func g4Gauge(t *testing.T, h *leaderHandle) float64 {
	t.Helper()
	fams, err := h.m.Registry.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() == "kvbm_g4_unavailable" {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("kvbm_g4_unavailable not exported")
	return 0
}

func waitG4On(t *testing.T, h *leaderHandle) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !h.l.G4On() {
		require.True(t, time.Now().Before(deadline), "G4 never turned on")
		time.Sleep(5 * time.Millisecond)
	}
}

// waitUnavailable waits until the store's first bucket check failed.
func waitUnavailable(t *testing.T, h *leaderHandle) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !h.l.G4Store().Unavailable() {
		require.True(t, time.Now().Before(deadline), "the bucket check never failed")
		time.Sleep(5 * time.Millisecond)
	}
}

// testFingerprint is a fingerprint of its own per call: each opens a new
// store (the process shares stores by fingerprint).
func testFingerprint(i int) fingerprint.Fingerprint {
	return fingerprint.Inputs{Model: fmt.Sprintf("g4check-%d-%d", time.Now().UnixNano(), i)}.Sum()
}

// TestSetG4FingerprintBlackholed: with the object store endpoint accepting
// connections and never answering, kvbm_leader_set_g4_fingerprint (called
// on vLLM's scheduler thread) returns at once; once the bucket check timed
// out, G4 is off (no G4 match, kvbm_g4_unavailable counts the store) until
// the endpoint answers, then on.
func TestSetG4FingerprintBlackholed(t *testing.T) {
	fastBucketChecks(t)
	bh := s3test.NewBlackhole(t)
	h := g4Leader(t, bh.Addr, "")
	base := g4Gauge(t, h)
	done := make(chan error, 1)
	go func() { done <- h.setG4Fingerprint(testFingerprint(0)) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(g4JoinTimeout):
		t.Fatal("kvbm_leader_set_g4_fingerprint waited on the object store")
	}
	require.NotNil(t, h.l.G4Store())
	waitUnavailable(t, h)
	require.False(t, h.l.G4On())
	require.Equal(t, base+1, g4Gauge(t, h))

	// The registry knows the prompt's blocks; G4 being off, none match.
	prompt := make([]uint32, 13)
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	for _, hs := range hashing.SequenceHashes(prompt, 4, hashing.DefaultSaltHash, nil) {
		h.l.G4Store().Registry().Add(hs)
	}
	n, _ := h.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 0, n)

	bh.Heal()
	waitG4On(t, h)
	require.Equal(t, base, g4Gauge(t, h))
	n, _ = h.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 12, n)
}

// TestLeaderNewG4Blackholed: a leader started with rank 0's fingerprint on
// a silent endpoint starts at once, G4 off once the check timed out, on
// when the endpoint answers.
func TestLeaderNewG4Blackholed(t *testing.T) {
	fastBucketChecks(t)
	bh := s3test.NewBlackhole(t)
	h := g4Leader(t, bh.Addr, testFingerprint(1).String())
	require.NotNil(t, h.l.G4Store())
	waitUnavailable(t, h)
	require.False(t, h.l.G4On())
	bh.Heal()
	waitG4On(t, h)
}

// TestSetG4FingerprintLatency measures the scheduler-side call against a
// blackholed endpoint (reported, not asserted: the liveness tests above
// assert that it returns).
func TestSetG4FingerprintLatency(t *testing.T) {
	bh := s3test.NewBlackhole(t) // never healed
	const n = 50
	lat := make([]time.Duration, 0, n)
	for i := range n {
		h := g4Leader(t, bh.Addr, "")
		start := time.Now()
		require.NoError(t, h.setG4Fingerprint(testFingerprint(100+i)))
		lat = append(lat, time.Since(start))
		require.False(t, h.l.G4On())
		h.close()
	}
	slices.Sort(lat)
	t.Logf("kvbm_leader_set_g4_fingerprint with a blackholed G4 endpoint, %d calls: p50 %s, p99 %s, max %s",
		n, lat[n/2], lat[n*99/100], lat[n-1])
}
