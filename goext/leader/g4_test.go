package leader

import (
	"bytes"
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/fingerprint"
	"github.com/kvbm/kvbm/goext/metrics"
	"github.com/kvbm/kvbm/goext/object"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/internal/s3test"
)

// g4Store returns a store on srv (nil: an address nothing listens on, for
// tests that only use the registry).
func g4Store(t *testing.T, srv *s3test.Server) *object.Store {
	t.Helper()
	if srv == nil {
		return storeAt(t, "127.0.0.1:1", false)
	}
	return storeAt(t, srv.Addr, true)
}

// storeAt returns a store on bucket "kv-leader" at host (created when
// create), with a registry of its own.
func storeAt(t *testing.T, host string, create bool) *object.Store {
	t.Helper()
	c, err := object.NewClient(object.ClientOptions{Host: host, Bucket: "kv-leader", Region: "us-east-1",
		AccessKey: s3test.AccessKey, SecretKey: s3test.SecretKey})
	require.NoError(t, err)
	if create {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, c.EnsureBucket(ctx, "us-east-1"))
	}
	s, err := object.NewStore(object.StoreOptions{Client: c, Fingerprint: fingerprint.Inputs{Model: "m"}.Sum(),
		BlockBytes: 64, Registry: object.NewRegistry(1000), BreakerCooldown: time.Hour})
	require.NoError(t, err)
	t.Cleanup(s.Close)
	return s
}

func newG4Env(t *testing.T, hostBlocks int, g4 *G4Options, edit ...func(*Options)) *env {
	t.Helper()
	e := &env{sink: &recSink{}, m: metrics.New(), clock: &fakeClock{t: time.Unix(1_000_000, 0)}, logs: &bytes.Buffer{}}
	o := Options{
		Config: &config.Config{CPUCacheOverrideBlocks: hostBlocks, CacheStatsMaxRequests: 1000,
			CacheStatsLogInterval: 5 * time.Second},
		BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Sink: e.sink, Metrics: e.m, Now: e.clock.Now,
		Logger: slog.New(slog.NewTextHandler(e.logs, nil)), G4: g4,
	}
	for _, f := range edit {
		f(&o)
	}
	l, err := New(o)
	require.NoError(t, err)
	e.l = l
	return e
}

// TestG4UploadsNewSaves: every block saved into G2 is uploaded once; a
// hash the registry knows is not uploaded again.
func TestG4UploadsNewSaves(t *testing.T) {
	s := g4Store(t, nil)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true})
	prompt := toks(100, 12)
	hs := seqHashes(prompt)
	s.Registry().Add(hs[1])
	st := e.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{5, 6, 7}, NumScheduledTokens: 12})
	require.Len(t, st.Saves, 3)
	require.Equal(t, []plan.Upload{
		{Block: st.Saves[0].DstBlock, Hash: hs[0]},
		{Block: st.Saves[2].DstBlock, Hash: hs[2], Parent: hs[1]},
	}, st.Uploads)
	// Write-through: the G2 copies stay.
	e.step(t)
	host, _ := e.l.BlocksUsed()
	require.Equal(t, 3, host)
}

// TestG4WriteThroughOff: an uploaded block leaves G2 in the next step (its
// upload copied it at the end of the step that saved it).
func TestG4WriteThroughOff(t *testing.T) {
	s := g4Store(t, nil)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: false})
	st := e.step(t, RequestUpdate{ReqID: "r", NewTokens: toks(100, 8), NewBlockIDs: []int64{5, 6}, NumScheduledTokens: 8})
	require.Len(t, st.Uploads, 2)
	host, _ := e.l.BlocksUsed()
	require.Equal(t, 2, host)
	st = e.step(t)
	host, _ = e.l.BlocksUsed()
	require.Equal(t, 0, host)
	require.ElementsMatch(t, []plan.Copy{{Src: plan.G2, SrcBlock: st.Drops[0].SrcBlock}, {Src: plan.G2, SrcBlock: st.Drops[1].SrcBlock}}, st.Drops)
	require.Len(t, st.Drops, 2)
}

// TestG4ContinuesG2Match: G2 prefix, then G4 (known to the registry) for the
// rest; each G4 block gets a G2 bounce block and the load downloads into it
// before copying to G1. The bounce is freed when the load finished, and a
// failed G4 load makes the registry forget the hash.
func TestG4ContinuesG2Match(t *testing.T) {
	s := g4Store(t, nil)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true})
	prompt := toks(300, 17) // 4 full blocks + 1 token
	hs := seqHashes(prompt)
	seed(t, e.l.host, prompt, 0)
	for _, h := range hs[1:3] {
		s.Registry().Add(h) // blocks 1, 2 in G4; block 3 nowhere
	}
	before := object.Snapshot()
	n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.True(t, async)
	require.Equal(t, 3*bs, n)
	after := object.Snapshot()
	require.Equal(t, uint64(2), after.LookupHits-before.LookupHits)
	require.Equal(t, uint64(1), after.LookupMisses-before.LookupMisses)

	e.l.UpdateStateAfterAlloc("r", []int64{10, 11, 12, 13, 14}, n)
	require.Equal(t, uint64(2), object.Snapshot().Onboarded-after.Onboarded, "obj2h counts planned G4 loads")
	st := e.step(t)
	require.Len(t, st.Loads, 1)
	cs := st.Loads[0].Copies
	require.Len(t, cs, 5)
	b1, b2 := cs[1].SrcBlock, cs[2].SrcBlock
	require.Equal(t, plan.G2, cs[1].Src)
	require.Equal(t, []plan.Copy{
		{Src: plan.G2, SrcBlock: cs[0].SrcBlock, Dst: plan.G1, DstBlock: 10},
		{Src: plan.G2, SrcBlock: b1, Dst: plan.G1, DstBlock: 11},
		{Src: plan.G2, SrcBlock: b2, Dst: plan.G1, DstBlock: 12},
		{Src: plan.G4, SrcBlock: int64(hs[1]), Dst: plan.G2, DstBlock: b1},
		{Src: plan.G4, SrcBlock: int64(hs[2]), Dst: plan.G2, DstBlock: b2},
	}, cs)
	require.NotEqual(t, b1, b2)
	require.Equal(t, 1, e.l.host.Info(int(b1)).Refs, "the bounce block is held by the load")

	e.l.LoadErrors([]int64{12})
	require.False(t, s.Registry().Contains(hs[2]), "a failed G4 load is forgotten")
	require.True(t, s.Registry().Contains(hs[1]))
	e.l.LoadsFinished([]string{"r"})
	require.Equal(t, 0, e.l.host.Info(int(b1)).Refs)
	require.Equal(t, 0, e.l.host.Info(int(b2)).Refs)
	host, _ := e.l.BlocksUsed()
	require.Equal(t, 1, host, "bounce blocks are never registered")
}

// TestG4FullPromptHitDropsLastG4Block: the engine must compute one token.
func TestG4FullPromptHitDropsLastG4Block(t *testing.T) {
	s := g4Store(t, nil)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true})
	prompt := toks(300, 8)
	for _, h := range seqHashes(prompt) {
		s.Registry().Add(h)
	}
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, bs, n)
	require.Equal(t, 15, e.l.host.NumFree(), "one bounce block taken")
	require.False(t, e.l.RequestFinished("r"))
	require.Equal(t, 16, e.l.host.NumFree(), "unstaged: the bounce block is free again")
}

// TestG4BounceLimitedByFreeG2: with every G2 block pinned, G4 blocks cannot
// be matched (nothing to download into).
func TestG4BounceLimitedByFreeG2(t *testing.T) {
	s := g4Store(t, nil)
	e := newG4Env(t, 2, &G4Options{Store: s, WriteThrough: true})
	prompt := toks(300, 17)
	for _, h := range seqHashes(prompt) {
		s.Registry().Add(h)
	}
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 2*bs, n, "two G2 blocks: two bounce blocks")
}

// TestG4AsyncLookupFromStore: blocks another instance stored are found by a
// background lookup; until it finished the leader answers Pending (nothing
// pinned), then the match includes them. Without Async it never waits.
func TestG4AsyncLookupFromStore(t *testing.T) {
	srv := s3test.Start(t)
	other := g4Store(t, srv) // another instance, same fingerprint
	prompt := toks(700, 13)
	hs := seqHashes(prompt)
	for _, h := range hs[:2] {
		require.True(t, other.Enqueue(h, 0, make([]byte, 64)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, other.Flush(ctx))

	s := g4Store(t, srv)
	e := newG4Env(t, 16, &G4Options{Store: s, Async: true, WriteThrough: true})
	n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, Pending, n)
	require.False(t, async)
	require.Equal(t, 16, e.l.host.NumFree(), "nothing pinned while pending")
	deadline := time.Now().Add(30 * time.Second)
	for n == Pending {
		require.True(t, time.Now().Before(deadline), "lookup never finished")
		time.Sleep(5 * time.Millisecond)
		n, async = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	}
	require.True(t, async)
	require.Equal(t, 2*bs, n)

	// Not async: the first answer uses the registry only (a new prefix:
	// nothing known yet), and the lookup fills the registry behind it.
	s2 := g4Store(t, srv)
	e2 := newG4Env(t, 16, &G4Options{Store: s2, WriteThrough: true})
	n, _ = e2.l.GetNumNewMatchedTokens("a", prompt, 0, 0)
	require.Equal(t, 0, n)
	for s2.Registry().PrefixLen(hs[:2]) < 2 {
		require.True(t, time.Now().Before(deadline), "background lookup never filled the registry")
		time.Sleep(5 * time.Millisecond)
	}
	n, _ = e2.l.GetNumNewMatchedTokens("b", prompt, 0, 0)
	require.Equal(t, 2*bs, n)
}

// TestG4WaitsBrieflyForTheStore: a leader whose rank 0 fingerprint is not
// known yet answers Pending (async engines), for StoreWait at most; with the
// store set, lookups run.
func TestG4WaitsBrieflyForTheStore(t *testing.T) {
	e := newG4Env(t, 16, &G4Options{Async: true, WriteThrough: true, StoreWait: time.Minute})
	prompt := toks(900, 9)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, Pending, n)
	e.clock.Advance(2 * time.Minute)
	n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 0, n, "past StoreWait: no G4, no waiting")
	require.False(t, async)

	e2 := newG4Env(t, 16, &G4Options{Async: true, WriteThrough: true, StoreWait: time.Minute})
	s := g4Store(t, nil)
	for _, h := range seqHashes(prompt) {
		s.Registry().Add(h)
	}
	require.True(t, e2.l.SetG4Store(s))
	require.False(t, e2.l.SetG4Store(s), "set once")
	n, async = e2.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 2*bs, n, "the store's registry answers")
	require.True(t, async)
}
