package leader

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/internal/s3test"
)

// checkedStore is a store on bh whose bucket check runs in the background,
// each attempt given up after attempt.
func checkedStore(t *testing.T, bh *s3test.Blackhole, attempt time.Duration) *object.Store {
	t.Helper()
	c, err := object.NewClient(object.ClientOptions{Host: bh.Addr, Bucket: "kv-leader", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fingerprint.Inputs{Model: "m"}.Sum(),
		BlockBytes: 64, Registry: object.NewRegistry(1000), BreakerCooldown: time.Hour,
		BucketCheck: &object.BucketCheck{Region: "us-east-1", Timeout: attempt,
			Retry: 10 * time.Millisecond, RetryMax: 20 * time.Millisecond}})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "still not %s", what)
		time.Sleep(5 * time.Millisecond)
	}
}

// TestG4OffUntilBucketAnswers: with rank 0's store known but its bucket
// check failing, G4 is off: a block the registry knows is not matched,
// nothing is pending (an async engine is not kept waiting), no upload is
// planned. When the bucket answers, G4 turns on.
func TestG4OffUntilBucketAnswers(t *testing.T) {
	for _, viaSet := range []bool{false, true} {
		bh := s3test.NewBlackhole(t)
		s := checkedStore(t, bh, 50*time.Millisecond)
		var e *env
		if viaSet {
			// Rank 0's fingerprint arrives after start (set_g4_fingerprint).
			e = newG4Env(t, 16, &G4Options{Async: true, WriteThrough: true, StoreWait: time.Hour})
			require.True(t, e.l.SetG4Store(s))
		} else {
			e = newG4Env(t, 16, &G4Options{Store: s, Async: true, WriteThrough: true})
		}
		prompt := toks(300, 13)
		for _, h := range seqHashes(prompt) {
			s.Registry().Add(h)
		}
		until(t, "unavailable", s.Unavailable)
		require.False(t, e.l.G4On())
		n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		require.Equal(t, 0, n, "no G4 match while off (via set: %v)", viaSet)
		require.False(t, async)
		st := e.step(t, RequestUpdate{ReqID: "w", NewTokens: toks(900, 8), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
		require.Len(t, st.Saves, 2)
		require.Empty(t, st.Uploads, "no upload planned while off")
		require.False(t, e.l.RequestFinished("r"))

		bh.Heal()
		until(t, "on", e.l.G4On)
		n, async = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		require.Equal(t, 3*bs, n, "on: the registry answers")
		require.True(t, async)
		st = e.step(t, RequestUpdate{ReqID: "w2", NewTokens: toks(1900, 4), NewBlockIDs: []int64{3}, NumScheduledTokens: 4})
		require.Len(t, st.Uploads, 1)
	}
}

// TestG4BeforeFirstBucketAnswer: while the first check is still running the
// tier is used as before (uploads planned, the registry matched): a healthy
// store answers within milliseconds of start, and a silent one only for the
// first attempt.
func TestG4BeforeFirstBucketAnswer(t *testing.T) {
	bh := s3test.NewBlackhole(t)
	s := checkedStore(t, bh, time.Hour)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true})
	prompt := toks(300, 13)
	for _, h := range seqHashes(prompt) {
		s.Registry().Add(h)
	}
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 3*bs, n)
	st := e.step(t, RequestUpdate{ReqID: "w", NewTokens: toks(900, 8), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	require.Len(t, st.Uploads, 2)
	require.False(t, s.Unavailable())
	require.False(t, e.l.G4On())
}
