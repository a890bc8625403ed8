package leader

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/consolidator"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/internal/s3test"
)

var (
	saltA = hashing.SaltHash("tenant-a", true, "", false)
	saltB = hashing.SaltHash("tenant-b", true, "", false)
)

// routerIndex replays consolidated events as a KV-aware router does: the
// set of block hashes it believes some holder caches.
type routerIndex struct {
	tr  *consolidator.Tracker
	set map[uint64]bool
}

func newRouterIndex() *routerIndex {
	return &routerIndex{tr: consolidator.NewTracker(consolidator.EngineVllm, nil), set: map[uint64]bool{}}
}

// feed applies kvbm's tier events and returns the router hashes removed.
func (r *routerIndex) feed(t *testing.T, evs []events.BlockEvent) (removed []uint64) {
	t.Helper()
	for i := range evs {
		r.tr.ApplyKvbm(&evs[i])
	}
	for _, ce := range r.tr.Drain(nil) {
		switch ce.Kind {
		case events.KindStored:
			r.set[ce.BlockHash] = true
		case events.KindRemoved:
			require.True(t, r.set[ce.BlockHash], "REMOVE of a block the router never saw")
			delete(r.set, ce.BlockHash)
			removed = append(removed, ce.BlockHash)
		}
	}
	return removed
}

type tenantPrompt struct {
	id     string
	salt   uint64
	tokens []uint32
}

// saveAll runs one step saving every prompt (3 full blocks each) into G2,
// then one that moves them to G3 (the offload filter is off).
func saveAll(t *testing.T, e *env, ps []tenantPrompt) {
	t.Helper()
	var ups []RequestUpdate
	for k, p := range ps {
		ids := []int64{int64(10 * k), int64(10*k + 1), int64(10*k + 2)}
		ups = append(ups, RequestUpdate{ReqID: p.id, NewTokens: p.tokens, NewBlockIDs: ids, NumScheduledTokens: len(p.tokens), Salt: p.salt})
	}
	e.step(t, ups...)
	e.step(t)
}

func filterOff(c *config.Config) { c.DisableDiskOffloadFilter = true }

// TestPurgeSalt: a purge of salt A forgets exactly A's blocks in G2 and G3
// (rehashing identifies them; nothing stores the salt), publishes their
// removal, drops them in the next step, and the router index built from
// the consolidator removes exactly A's blocks: a prompt that salt B also
// caches keeps its router entry (router keys carry no salt), other salts'
// prompts still match in kvbm.
func TestPurgeSalt(t *testing.T) {
	e := newEnv(t, 32, 32, filterOff)
	pa, pb, shared, pd := toks(100, 12), toks(200, 12), toks(500, 12), toks(300, 12)
	ps := []tenantPrompt{{"a1", saltA, pa}, {"a2", saltA, shared}, {"b1", saltB, pb}, {"b2", saltB, shared}, {"d", 0, pd}}
	saveAll(t, e, ps)
	require.Equal(t, 15, e.l.host.NumRegistered())
	require.Equal(t, 15, e.l.disk.NumRegistered())
	idx := newRouterIndex()
	idx.feed(t, e.sink.take())
	before := len(idx.set)

	res, err := e.l.Purge(context.Background(), PurgeRequest{Salts: []uint64{saltA}})
	require.NoError(t, err)
	require.Equal(t, PurgeResult{HostBlocks: 6, DiskBlocks: 6}, res)
	require.Equal(t, 6.0, series(t, e.l, "kvbm_purged_blocks", "g2"))
	require.Equal(t, 6.0, series(t, e.l, "kvbm_purged_blocks", "g3"))
	require.Equal(t, 1.0, series(t, e.l, "kvbm_purges", ""))
	removed := idx.feed(t, e.sink.take())
	require.Len(t, removed, 3, "the router forgets pa's three blocks; shared is still B's")
	require.Len(t, idx.set, before-3)

	for _, p := range ps {
		hs := seqHashesSalt(p.tokens, cmpOr(p.salt, hashing.DefaultSaltHash))
		want := 3
		if p.salt == saltA {
			want = 0
		}
		require.Equal(t, want, e.l.host.MatchLen(hs), p.id)
		require.Equal(t, want, e.l.disk.MatchLen(hs), p.id)
	}
	n, _ := e.l.GetNumNewMatchedTokens("again-a", pa, saltA, 0)
	require.Zero(t, n, "salt A recomputes")
	n, _ = e.l.GetNumNewMatchedTokens("again-b", pb, saltB, 0)
	require.Positive(t, n, "salt B still hits")

	st := e.step(t)
	require.Len(t, st.Drops, 12, "every purged block is dropped by the workers")

	// The default salt names no tenant; empty or mixed requests are refused.
	for _, bad := range []PurgeRequest{{}, {Salts: []uint64{hashing.DefaultSaltHash}}, {All: true, Salts: []uint64{saltB}},
		{Prefix: toks(1, bs-1)}} {
		_, err := e.l.Purge(context.Background(), bad)
		require.ErrorContains(t, err, "leader: purge:")
	}
}

func cmpOr(a, b uint64) uint64 {
	if a != 0 {
		return a
	}
	return b
}

// TestPurgePrefix: a prefix purge forgets the prefix's blocks and every
// block continuing them, in both tiers, and nothing else.
func TestPurgePrefix(t *testing.T) {
	e := newEnv(t, 32, 32, filterOff)
	long, other := toks(100, 12), toks(700, 12)
	saveAll(t, e, []tenantPrompt{{"l", saltB, long}, {"o", saltB, other}})
	res, err := e.l.Purge(context.Background(), PurgeRequest{Prefix: long[:bs+1], PrefixSalt: saltB})
	require.NoError(t, err)
	require.Equal(t, 3, res.HostBlocks, "the first block and its two descendants")
	require.Equal(t, 3, res.DiskBlocks)
	require.Zero(t, e.l.host.MatchLen(seqHashesSalt(long, saltB)))
	require.Equal(t, 3, e.l.host.MatchLen(seqHashesSalt(other, saltB)))

	all, err := e.l.Purge(context.Background(), PurgeRequest{All: true})
	require.NoError(t, err)
	require.Equal(t, PurgeResult{HostBlocks: 3, DiskBlocks: 3}, all)
	require.Zero(t, e.l.host.NumRegistered()+e.l.disk.NumRegistered())
}

// TestPurgePersistentRestart: purged blocks of a persistent G3 tier are not
// recovered by a restart, even one before any later step reached the
// workers (a crash right after the purge), nor by a second restart; other
// salts' blocks are, and the purged ones are dropped in the first step.
func TestPurgePersistentRestart(t *testing.T) {
	dir := t.TempDir()
	persist := func(c *config.Config) { c.DiskPersist = true; c.DiskCacheDir = dir }
	e := newEnv(t, 0, 16, persist) // disk only: saves go G1→G3 with tags
	st := e.step(t,
		RequestUpdate{ReqID: "a", NewTokens: toks(100, 12), NewBlockIDs: []int64{1, 2, 3}, NumScheduledTokens: 12, Salt: saltA},
		RequestUpdate{ReqID: "b", NewTokens: toks(100, 12), NewBlockIDs: []int64{4, 5, 6}, NumScheduledTokens: 12, Salt: saltB})
	require.Len(t, st.Tags, 6)
	res, err := e.l.Purge(context.Background(), PurgeRequest{Salts: []uint64{saltA}})
	require.NoError(t, err)
	require.Equal(t, 3, res.DiskBlocks)
	var aBlocks []int64
	for _, tg := range st.Tags[:3] {
		aBlocks = append(aBlocks, tg.Block)
	}

	for restart := range 2 { // the second: the first never stepped
		e2 := newEnv(t, 0, 16, persist)
		got, err := e2.l.RestoreDisk([][]RecoveredBlock{recoveredFrom(st.Tags, 1000)})
		require.NoError(t, err)
		require.Equal(t, 3, got.Registered, "restart %d", restart)
		require.Equal(t, 3, got.Skipped[SkipPurged], "restart %d", restart)
		require.Zero(t, e2.l.disk.MatchLen(seqHashesSalt(toks(100, 12), saltA)))
		require.Equal(t, 3, e2.l.disk.MatchLen(seqHashesSalt(toks(100, 12), saltB)))
		if restart == 1 {
			s := e2.step(t)
			var dropped []int64
			for _, d := range s.Drops {
				require.Equal(t, plan.G3, d.Src)
				dropped = append(dropped, d.SrcBlock)
			}
			slices.Sort(dropped)
			require.Equal(t, aBlocks, dropped, "the first step drops the purged blocks on disk")
		}
	}
}

// TestDiskTTL: the G3 expiry sweep examines at most DiskSweepSlots slots a
// pass (so a pass costs the same whatever the tier's size), forgets what
// is older than the TTL and nothing younger, and a restart skips expired
// blocks.
func TestDiskTTL(t *testing.T) {
	const capacity = 2*DiskSweepSlots + 100
	e := newEnv(t, 0, capacity, func(c *config.Config) { c.Lifecycle.DiskTTL = time.Hour })
	e.l.Close() // the test runs the passes itself
	old := toks(0, (capacity-50)*bs)
	seed(t, e.l.disk, old, seqRange(capacity-50)...)
	e.clock.Advance(time.Hour + time.Second)
	fresh := toks(1<<24, 10*bs)
	seed(t, e.l.disk, fresh, seqRange(10)...)
	e.sink.take()

	total := 0
	for pass := 0; pass < 3; pass++ {
		n := e.l.SweepDisk()
		require.LessOrEqual(t, n, DiskSweepSlots)
		total += n
	}
	require.Equal(t, capacity-50, total, "three passes cover the tier once")
	require.Equal(t, 10, e.l.disk.NumRegistered(), "younger blocks stay")
	require.Zero(t, e.l.SweepDisk())
	removed := 0
	for _, ev := range e.sink.take() {
		if ev.Removed {
			removed++
		}
	}
	require.Equal(t, capacity-50, removed)
	require.Equal(t, uint64(capacity-50), e.l.Stats().Lifecycle.ExpiredDisk)
	require.Equal(t, float64(capacity-50), series(t, e.l, "kvbm_expired_blocks", "g3"))

	// A restart skips blocks written before the TTL.
	dir := t.TempDir()
	e2 := newEnv(t, 0, 8, func(c *config.Config) {
		c.DiskPersist, c.DiskCacheDir, c.Lifecycle.DiskTTL = true, dir, time.Hour
	})
	e2.l.Close()
	hs := seqHashes(toks(100, 8))
	now := e2.clock.Now().UnixNano()
	rec := []RecoveredBlock{
		{BlockTag: plan.BlockTag{Block: 0, SeqHash: hs[0], Tokens: toks(100, bs)}, WrittenAt: now - int64(2*time.Hour)},
		{BlockTag: plan.BlockTag{Block: 1, SeqHash: hs[1], Parent: hs[0], HasParent: true, Tokens: toks(100+bs, bs)}, WrittenAt: now - int64(time.Minute)},
	}
	got, err := e2.l.RestoreDisk([][]RecoveredBlock{rec})
	require.NoError(t, err)
	require.Equal(t, 1, got.Registered)
	require.Equal(t, 1, got.Skipped[SkipExpired])
}

func seqRange(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// TestPurgeG4 (versitygw): a salted request's uploads carry its salt in the
// step (workers key the objects by the salt's tag); a purge of the salt
// deletes its objects in the bucket and forgets them in the G4 registry
// (G4 tier REMOVE events), while another salt's objects stay and match.
func TestPurgeG4(t *testing.T) {
	srv := s3test.Start(t)
	s := g4Store(t, srv)
	buf := events.NewBuffer(0)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true, Events: buf})
	t.Cleanup(e.l.Close)
	pa, pb := toks(100, 12), toks(200, 12)
	st := e.step(t,
		RequestUpdate{ReqID: "a", NewTokens: pa, NewBlockIDs: []int64{1, 2, 3}, NumScheduledTokens: 12, Salt: saltA},
		RequestUpdate{ReqID: "b", NewTokens: pb, NewBlockIDs: []int64{4, 5, 6}, NumScheduledTokens: 12, Salt: saltB})
	require.Len(t, st.Uploads, 6)
	require.Len(t, st.G4Salts, 6)
	saltOf := st.SaltOf()
	payload := make([]byte, 64)
	for _, u := range st.Uploads { // what the worker does with the step
		require.True(t, s.EnqueueSalted(saltOf(u.Hash), u.Hash, u.Parent, payload))
	}
	require.NoError(t, s.Flush(context.Background()))
	ha, hb := seqHashesSalt(pa, saltA), seqHashesSalt(pb, saltB)
	held := map[uint64]bool{}
	g4Held(t, held, buf.Drain())
	require.Len(t, held, 6)

	res, err := e.l.Purge(context.Background(), PurgeRequest{Salts: []uint64{saltA}})
	require.NoError(t, err)
	require.Equal(t, 3, res.G4Deleted)
	require.Equal(t, 3.0, series(t, e.l, "kvbm_purged_blocks", "g4"))
	require.Equal(t, 3, res.G4Listed)
	require.Equal(t, 3, res.G4Forgotten)
	g4Held(t, held, buf.Drain())
	require.Equal(t, map[uint64]bool{hb[0]: true, hb[1]: true, hb[2]: true}, held)
	ctx := context.Background()
	s.Registry().RemoveAll()
	require.Zero(t, s.LookupSalted(ctx, saltA, ha), "the bucket holds no object of salt A")
	require.Equal(t, 3, s.LookupSalted(ctx, saltB, hb))
}

// TestPurgeRecheck (versitygw): an upload of the purged salt that lands
// after the purge (queued before it) is deleted by the second pass.
func TestPurgeRecheck(t *testing.T) {
	old := PurgeRecheck
	PurgeRecheck = 50 * time.Millisecond
	t.Cleanup(func() { PurgeRecheck = old })
	srv := s3test.Start(t)
	s := g4Store(t, srv)
	e := newG4Env(t, 16, &G4Options{Store: s, WriteThrough: true})
	_, err := e.l.Purge(context.Background(), PurgeRequest{Salts: []uint64{saltA}})
	require.NoError(t, err)
	require.True(t, s.EnqueueSalted(saltA, 42, 0, make([]byte, 64))) // a straggler
	require.NoError(t, s.Flush(context.Background()))
	require.Eventually(t, func() bool {
		s.Registry().RemoveAll()
		return s.LookupSalted(context.Background(), saltA, []uint64{42}) == 0
	}, 10*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return series(t, e.l, "kvbm_purged_blocks", "g4") == 1 },
		10*time.Second, 20*time.Millisecond, "the second pass's deletion is counted")
	e.l.Close()
}

// TestObjectTTL (versitygw): the leader's G4 expiry pass deletes objects
// older than DYN_KVBM_OBJECT_TTL_SECS (here: by advancing the leader's
// clock past it), at most ObjectSweepObjects per pass, and their registry
// entries; nothing younger goes.
func TestObjectTTL(t *testing.T) {
	srv := s3test.Start(t)
	s := g4Store(t, srv)
	e := &env{sink: &recSink{}, clock: &fakeClock{t: time.Now()}}
	l, err := New(Options{
		Config: &config.Config{CPUCacheOverrideBlocks: 8, CacheStatsMaxRequests: 10,
			Lifecycle: config.Lifecycle{ObjectTTL: time.Hour}},
		BlockSize: bs, BytesPerBlock: 64, NumWorkers: 1, Now: e.clock.Now,
		G4: &G4Options{Store: s, WriteThrough: true},
	})
	require.NoError(t, err)
	l.Close() // the test runs the passes itself
	for h := uint64(1); h <= 4; h++ {
		require.True(t, s.EnqueueSalted(saltA, h, 0, make([]byte, 64)))
	}
	require.NoError(t, s.Flush(context.Background()))
	require.Zero(t, l.SweepObjects(context.Background()).Deleted, "nothing is an hour old")
	e.clock.Advance(2 * time.Hour)
	res := l.SweepObjects(context.Background())
	require.Equal(t, 4, res.Deleted)
	require.Equal(t, uint64(4), l.Stats().Lifecycle.ExpiredObjects)
	require.Equal(t, 4.0, series(t, l, "kvbm_expired_blocks", "g4"))
	require.Zero(t, s.Registry().Len())
	require.Zero(t, s.LookupSalted(context.Background(), saltA, []uint64{1}))
}

// series is the value of the leader's metric name (with label tier, unless
// tier is "") as its Prometheus endpoint serves it (0: not exported).
func series(t *testing.T, l *Leader, name, tier string) float64 {
	t.Helper()
	fams, err := l.m.Registry.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			got := ""
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "tier" {
					got = lp.GetValue()
				}
			}
			if got == tier {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}
