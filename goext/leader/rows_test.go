package leader

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/plan"
)

// A matched request's first update carries only the tokens after those the
// leader got at matching; its saves are those of a full update.
func TestKnownTokensFromMatching(t *testing.T) {
	full, known := newEnv(t, 16, 0, nil), newEnv(t, 16, 0, nil)
	prompt := toks(100, 10)
	for _, e := range []*env{full, known} {
		got, _ := e.l.GetNumNewMatchedTokens("r", prompt[:8], 0, 0)
		require.Zero(t, got)
	}
	a := full.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{1, 2, 3}, NumScheduledTokens: 10})
	b := known.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt[8:], KnownTokens: 8, NewBlockIDs: []int64{1, 2, 3},
		NumScheduledTokens: 10})
	require.Equal(t, a.Saves, b.Saves)
	require.Len(t, b.Saves, 2)
	// Matched with a partial G1 hit (no load): the tokens are kept too.
	got, _ := known.l.GetNumNewMatchedTokens("s", prompt, 0, 2)
	require.Zero(t, got)
	st := known.step(t, RequestUpdate{ReqID: "s", KnownTokens: 10, NewBlockIDs: []int64{4, 5, 6}, NumComputedTokens: 2,
		NumScheduledTokens: 8})
	require.Len(t, st.Saves, 0) // the same blocks are in G2 already: nothing to copy
	require.False(t, known.l.slots["s"].stopped)
}

// An update that says the leader has tokens it does not have (the request
// was forgotten since matching) leaves the request without offload.
func TestKnownTokensTheLeaderLost(t *testing.T) {
	e := newEnv(t, 16, 0, nil)
	st := e.step(t, RequestUpdate{ReqID: "r", NewTokens: toks(100, 2), KnownTokens: 8, NewBlockIDs: []int64{1, 2, 3},
		NumScheduledTokens: 10})
	require.Empty(t, st.Saves)
	require.True(t, e.l.slots["r"].stopped)
}

// With KV cache groups the plan carries a row per G1 block it copies, from
// the groups' blocks the updates carried.
func TestGroupRowsBuiltByTheLeader(t *testing.T) {
	e := newEnvWith(t, 16, 0, nil, func(o *Options) {
		o.Groups = &Groups{Primary: 0, Windows: [][2]int{{0, 0}, {4, 0}}}
	})
	prompt := toks(100, 12)
	st := e.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{1, 2, 3},
		NumScheduledTokens: 12, Groups: &GroupBlocks{Replace: true, Blocks: [][]int64{{1, 2, 3}, {0, 8, 9}}}})
	require.Len(t, st.Saves, 3)
	require.NotNil(t, st.G1Groups)
	// Block 1's position is the null block of group 1: its save gets a row
	// of no blocks (it fails); the saves of positions 1 and 2 read both groups.
	require.Equal(t, map[int64][]int64{1: {noBlock, noBlock}, 2: {2, 8}, 3: {3, 9}}, st.G1Groups.Map())
	// An update without group blocks: an (empty) row set all the same.
	st = e.step(t, RequestUpdate{ReqID: "r", NewTokens: []uint32{7}, NumComputedTokens: 12, NumScheduledTokens: 1})
	require.NotNil(t, st.G1Groups)
	require.Empty(t, st.G1Groups.Rows)
	// A load's rows come from the blocks allocated for it.
	e2 := newEnvWith(t, 16, 0, nil, func(o *Options) {
		o.Groups = &Groups{Primary: 1, Windows: [][2]int{{0, 0}, {0, 0}}}
	})
	seed(t, e2.l.host, prompt, 0, 1, 2)
	got, async := e2.l.GetNumNewMatchedTokens("q", append(prompt, 1), 0, 0)
	require.Equal(t, 12, got)
	require.True(t, async)
	e2.l.UpdateStateAfterAlloc("q", []int64{21, 22, 23, 24}, 12)
	e2.l.NoteAllocGroups("q", [][]int64{{11, 12, 13, 14}, {21, 22, 23, 24}})
	st = e2.step(t)
	require.Len(t, st.Loads, 1)
	rows := st.G1Groups.Map()
	for _, c := range st.Loads[0].Copies {
		if c.Dst == plan.G1 {
			require.Equal(t, []int64{c.DstBlock - 10, c.DstBlock}, rows[c.DstBlock])
		}
	}
	require.Len(t, rows, 3)
}

// A save planned late (retried after G2 was full) for a position whose
// sliding-window block vLLM may have freed since: its row is incomplete, so
// the worker fails it rather than read a block another request may hold now.
func TestASaveFromAPositionTheWindowLeftGetsNoRow(t *testing.T) {
	e := newEnvWith(t, 16, 0, nil, func(o *Options) {
		o.Groups = &Groups{Primary: 0, Windows: [][2]int{{0, 0}, {2 * bs, 0}}}
	})
	a0, a1 := []int64{1, 2, 3, 4, 5, 6}, []int64{7, 8, 9, 10, 11, 12}
	s, _ := e.l.slotFor("a", 0, e.clock.Now())
	s.noteGroups(&GroupBlocks{Replace: true, Blocks: [][]int64{a0, a1}}, 0)
	st := &plan.Step{Seq: 1, Saves: []plan.Copy{save(a0[0], plan.G2, 0), save(a0[4], plan.G2, 1)}}
	// 5 blocks computed, window 2 blocks: the sliding group may have freed blocks 0..2.
	e.l.addGroupRows(st, []RequestUpdate{{ReqID: "a", NumComputedTokens: 5 * bs}})
	require.Equal(t, map[int64][]int64{a0[0]: {noBlock, noBlock}, a0[4]: {a0[4], a1[4]}}, st.G1Groups.Map())
}
