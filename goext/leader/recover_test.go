package leader

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/plan"
)

func persistOn(c *config.Config) { c.DiskPersist = true }

// recoveredFrom turns a step's tags into what a worker would recover.
func recoveredFrom(tags []plan.BlockTag, at int64) []RecoveredBlock {
	out := make([]RecoveredBlock, len(tags))
	for k, tg := range tags {
		out[k] = RecoveredBlock{BlockTag: tg, WrittenAt: at + int64(k)}
	}
	return out
}

// TestTagsAndRestore: with persistence on, every G3 write of a step carries
// its block's hash, parent, tokens and priority; a new leader given those
// tags registers the blocks at the same indexes, announces them parents
// first, and matches the prompt at once.
func TestTagsAndRestore(t *testing.T) {
	e := newEnv(t, 0, 8, persistOn) // disk only: saves go G1→G3
	prompt := toks(100, 14)
	hs := seqHashes(prompt)
	st := e.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{10, 11, 12, 13},
		NumScheduledTokens: 14, Priorities: []int{5, 5, 5, 5}})
	require.Len(t, st.Saves, 3)
	require.Len(t, st.Tags, 3)
	for k, tg := range st.Tags {
		require.Equal(t, st.Saves[k].DstBlock, tg.Block)
		require.Equal(t, hs[k], tg.SeqHash)
		require.Equal(t, k > 0, tg.HasParent)
		if k > 0 {
			require.Equal(t, hs[k-1], tg.Parent)
		}
		require.Equal(t, prompt[k*bs:(k+1)*bs], tg.Tokens)
		require.Equal(t, int32(5), tg.Priority)
	}

	// Without persistence, no tags.
	plain := newEnv(t, 0, 8, nil)
	st2 := plain.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{10, 11, 12, 13}, NumScheduledTokens: 14})
	require.Len(t, st2.Saves, 3)
	require.Empty(t, st2.Tags)

	e2 := newEnv(t, 0, 8, persistOn)
	// Reverse order: the leader must put parents first itself.
	rec := recoveredFrom(st.Tags, 1000)
	slices.Reverse(rec)
	got, err := e2.l.RestoreDisk([][]RecoveredBlock{rec})
	require.NoError(t, err)
	require.Equal(t, 3, got.Registered)
	evs := e2.sink.take()
	require.Len(t, evs, 3)
	for k, ev := range evs {
		require.False(t, ev.Removed)
		require.Equal(t, hs[k], ev.SeqHash, "event %d", k)
		require.Equal(t, k > 0, ev.HasParent)
		require.Equal(t, prompt[k*bs:(k+1)*bs], ev.Tokens)
	}
	for _, tg := range st.Tags {
		require.True(t, e2.l.disk.Holds(int(tg.Block), tg.SeqHash))
	}
	n, async := e2.l.GetNumNewMatchedTokens("again", prompt, 0, 0)
	require.Equal(t, 12, n)
	require.True(t, async)

	// New writes never take a recovered block while free ones remain.
	e2.l.UpdateStateAfterAlloc("again", []int64{20, 21, 22, 23}, 12)
	st3 := e2.step(t, RequestUpdate{ReqID: "other", NewTokens: toks(900, 8), NewBlockIDs: []int64{30, 31}, NumScheduledTokens: 8})
	require.Len(t, st3.Loads, 1)
	for _, c := range st3.Saves {
		for _, tg := range st.Tags {
			require.NotEqual(t, tg.Block, c.DstBlock)
		}
	}

	// A second restore (in process, then through the engine) does nothing.
	again, err := e2.l.RestoreDisk([][]RecoveredBlock{rec})
	require.NoError(t, err)
	require.Zero(t, again.Registered)
	// A restore after the tier was used is refused.
	e3 := newEnv(t, 0, 8, persistOn)
	e3.step(t, RequestUpdate{ReqID: "x", NewTokens: toks(300, 8), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	_, err = e3.l.RestoreDisk([][]RecoveredBlock{rec})
	require.Error(t, err)
}

// TestRestoreIntersectsRanks: a block is registered only when every rank
// recovered it at the same index under the same hash; of two copies of one
// hash the newer wins.
func TestRestoreIntersectsRanks(t *testing.T) {
	prompt := toks(7, 16)
	hs := seqHashes(prompt)
	tg := func(block int64, k int) plan.BlockTag {
		t := plan.BlockTag{Block: block, SeqHash: hs[k], Tokens: prompt[k*bs : (k+1)*bs]}
		if k > 0 {
			t.Parent, t.HasParent = hs[k-1], true
		}
		return t
	}
	rank0 := []RecoveredBlock{
		{BlockTag: tg(0, 0), WrittenAt: 1}, {BlockTag: tg(1, 1), WrittenAt: 2},
		{BlockTag: tg(2, 2), WrittenAt: 3}, {BlockTag: tg(3, 3), WrittenAt: 4},
		{BlockTag: tg(5, 1), WrittenAt: 9},  // a newer copy of block 1's hash
		{BlockTag: tg(40, 2), WrittenAt: 9}, // beyond the tier
	}
	rank1 := []RecoveredBlock{
		{BlockTag: tg(0, 0), WrittenAt: 1}, {BlockTag: tg(1, 1), WrittenAt: 2},
		{BlockTag: tg(3, 3), WrittenAt: 4}, // block 2 torn on this rank
		{BlockTag: tg(5, 1), WrittenAt: 9}, {BlockTag: tg(40, 2), WrittenAt: 9},
	}
	e := newEnv(t, 0, 8, persistOn)
	got, err := e.l.RestoreDisk([][]RecoveredBlock{rank0, rank1})
	require.NoError(t, err)
	require.Equal(t, 3, got.Registered) // hashes 0, 1 (at block 5), 3
	require.Equal(t, map[string]int{SkipRanksDisagree: 1, SkipDuplicate: 1, SkipOutOfRange: 1}, got.Skipped)
	require.True(t, e.l.disk.Holds(5, hs[1]))
	require.False(t, e.l.disk.Holds(1, hs[1]))
	require.False(t, e.l.disk.Holds(2, hs[2]))
	// Matching stops at the missing block 2.
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 8, n)
}

// TestBackgroundTags: with persistence on in background mode, the engine
// step that saves a G2 block carries its tag (a HostTag with an opaque id);
// the background operation that moves it to G3 names that tag by id only
// (it goes over the side channel: no tokens, no hashes).
func TestBackgroundTags(t *testing.T) {
	cfg := func(c *config.Config) { persistOn(c); c.DisableDiskOffloadFilter = true }
	e := newEnv(t, 8, 8, cfg)
	e.l.bgMode = true
	prompt := toks(50, 8)
	hs := seqHashes(prompt)
	saved := e.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	require.Len(t, saved.HostTags, 2)
	ids := map[int64]uint64{} // G2 block → id
	for k, ht := range saved.HostTags {
		require.Equal(t, saved.Saves[k].DstBlock, ht.Block)
		require.Equal(t, hs[k], ht.SeqHash)
		require.Equal(t, prompt[k*bs:(k+1)*bs], ht.Tokens)
		require.NotZero(t, ht.ID)
		ids[ht.Block] = ht.ID
	}
	require.NotEqual(t, saved.HostTags[0].ID, saved.HostTags[1].ID)

	b, ticket, err := e.l.PlanBackground()
	require.NoError(t, err)
	require.NotZero(t, ticket)
	st, err := plan.Decode(b)
	require.NoError(t, err)
	require.Len(t, st.Moves, 2)
	require.Empty(t, st.Tags)
	require.Empty(t, st.HostTags)
	require.Len(t, st.TagRefs, 2)
	for k, r := range st.TagRefs {
		require.Equal(t, st.Moves[k].DstBlock, r.Block)
		require.Equal(t, ids[st.Moves[k].SrcBlock], r.ID)
	}
	require.NoError(t, e.l.CommitBackground(ticket, true))

	// Without background mode, engine steps carry no HostTags.
	plain := newEnv(t, 8, 8, cfg)
	require.Empty(t, plain.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8}).HostTags)
}

// TestResetDropsPinnedPersistentBlocks: a cache reset drops every G3 block
// of a persistent tier, pinned ones included, so none stays recoverable.
func TestResetDropsPinnedPersistentBlocks(t *testing.T) {
	for _, persist := range []bool{false, true} {
		e := newEnv(t, 0, 8, func(c *config.Config) { c.DiskPersist = persist })
		prompt := toks(10, 12)
		seed(t, e.l.disk, prompt, 0, 1)
		n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		require.Equal(t, 8, n)
		e.l.UpdateStateAfterAlloc("r", []int64{4, 5, 6}, n)
		st := e.step(t) // the load is emitted: its sources stay pinned
		require.Len(t, st.Loads, 1)
		e.l.ResetCache()
		st = e.step(t)
		if persist {
			require.Len(t, st.Drops, 2)
		} else {
			require.Empty(t, st.Drops, "without persistence a pinned block goes back to the free list silently")
		}
	}
}
