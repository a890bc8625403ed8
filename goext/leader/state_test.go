package leader

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/hashing"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/internal/s3test"
)

// A hybrid model with a recurrent-state group (group 0) beside full
// attention (group 1): the position a step ends on is stored a second time
// under its state key, with the state group's block in its row; a hit ends
// on a stored state, and only its last position loads the state layers.
func TestStateGroups(t *testing.T) {
	e := newEnvWith(t, 32, 0, nil, func(o *Options) {
		o.Groups = &Groups{Primary: 1, Windows: [][2]int{{0, 0}, {0, 0}}, State: []bool{true, false}}
	})
	prompt := toks(100, 3*bs+1)
	hs := seqHashes(prompt)
	// The prefill step ends on block 2's last token; the state group holds
	// the state there (vLLM's align mode: nulls before it).
	st := e.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: []int64{1, 2, 3},
		NumScheduledTokens: 3 * bs, Groups: &GroupBlocks{Replace: true, Blocks: [][]int64{{0, 0, 7}, {1, 2, 3}}}})
	require.Len(t, st.Saves, 4) // three positions, and position 2 with its state
	require.Equal(t, []int64{1, 2, 3, 3}, []int64{st.Saves[0].SrcBlock, st.Saves[1].SrcBlock, st.Saves[2].SrcBlock,
		st.Saves[3].SrcBlock})
	// Positions without a state are saved without the state layers (not failed).
	require.Equal(t, map[int64][]int64{1: {noBlock, 1}, 2: {noBlock, 2}, 3: {7, 3}}, st.G1Groups.Map())
	for i, h := range hs {
		_, ok := e.l.host.Lookup(h)
		require.True(t, ok, "position %d", i)
		_, ok = e.l.host.Lookup(hashing.StateHash(h))
		require.Equal(t, i == 2, ok, "state of position %d", i)
	}
	// The next step (the prompt's last token) ends inside block 3: nothing.
	st = e.step(t, RequestUpdate{ReqID: "r", NewBlockIDs: []int64{4}, NumComputedTokens: 3 * bs, NumScheduledTokens: 1,
		Groups: &GroupBlocks{Blocks: [][]int64{{8}, {4}}}})
	require.Empty(t, st.Saves)

	// A prompt ending inside block 2, where no state was kept: no hit,
	// although positions 0 and 1 are stored.
	got, _ := e.l.GetNumNewMatchedTokens("head", prompt[:2*bs+1], 0, 0)
	require.Zero(t, got)
	// A prompt of whole blocks: the hit must leave the engine a token, so it
	// could end only at position 1, which has no state: none.
	got, _ = e.l.GetNumNewMatchedTokens("whole", prompt[:3*bs], 0, 0)
	require.Zero(t, got)

	// The same prompt again: 3 blocks, the last from its state key.
	got, async := e.l.GetNumNewMatchedTokens("q", prompt, 0, 0)
	require.Equal(t, 3*bs, got)
	require.True(t, async)
	staged := e.l.slots["q"].staged
	require.Equal(t, hashing.StateHash(hs[2]), staged[2].hash)
	require.Equal(t, hs[1], staged[1].hash)
	e.l.UpdateStateAfterAlloc("q", []int64{21, 22, 23, 24}, 3*bs)
	// An interior state entry (never in align mode) is not loaded either.
	e.l.NoteAllocGroups("q", [][]int64{{30, 0, 31, 32}, {21, 22, 23, 24}})
	st = e.step(t)
	require.Len(t, st.Loads, 1)
	require.Equal(t, map[int64][]int64{21: {noBlock, 21}, 22: {noBlock, 22}, 23: {31, 23}}, st.G1Groups.Map())
	var srcs []int64
	for _, c := range st.Loads[0].Copies {
		if c.Dst == plan.G1 {
			srcs = append(srcs, c.SrcBlock)
		}
	}
	idx, _ := e.l.host.Lookup(hashing.StateHash(hs[2]))
	require.Equal(t, int64(idx), srcs[len(srcs)-1], "the last position loads from the state block")
}

// Without a state kept anywhere in the prefix the match is empty, whatever
// the attention blocks: a hit would load garbage into the state block.
func TestStateCutWithoutAnyState(t *testing.T) {
	e := newEnvWith(t, 32, 0, nil, func(o *Options) {
		o.Groups = &Groups{Primary: 1, Windows: [][2]int{{0, 0}, {0, 0}}, State: []bool{true, false}}
	})
	prompt := toks(100, 4*bs+1)
	seed(t, e.l.host, prompt, 0, 1, 2, 3)
	got, _ := e.l.GetNumNewMatchedTokens("q", prompt, 0, 0)
	require.Zero(t, got)
	// The same blocks without state groups: a hit of all four.
	e2 := newEnv(t, 32, 0, nil)
	seed(t, e2.l.host, prompt, 0, 1, 2, 3)
	got, _ = e2.l.GetNumNewMatchedTokens("q", prompt, 0, 0)
	require.Equal(t, 4*bs, got)
}

// A save of a position planned in a later step than the one that ended on
// it (retried after G2 was full) does not read the state group's block:
// vLLM has let go of it since.
func TestStateBlockReadOnlyInTheStepEndingThere(t *testing.T) {
	e := newEnvWith(t, 32, 0, nil, func(o *Options) {
		o.Groups = &Groups{Primary: 1, Windows: [][2]int{{0, 0}, {0, 0}}, State: []bool{true, false}}
	})
	s, _ := e.l.slotFor("a", 0, e.clock.Now())
	s.noteGroups(&GroupBlocks{Replace: true, Blocks: [][]int64{{0, 0, 7}, {1, 2, 3}}}, 1)
	st := &plan.Step{Seq: 1, Saves: []plan.Copy{save(3, plan.G2, 0)}}
	e.l.addGroupRows(st, []RequestUpdate{{ReqID: "a", NumScheduledTokens: 3 * bs}})
	require.Equal(t, map[int64][]int64{3: {7, 3}}, st.G1Groups.Map())
	st = &plan.Step{Seq: 2, Saves: []plan.Copy{save(3, plan.G2, 0)}}
	e.l.addGroupRows(st, []RequestUpdate{{ReqID: "a", NumComputedTokens: 3 * bs, NumScheduledTokens: 1}})
	require.Equal(t, map[int64][]int64{3: {noBlock, 3}}, st.G1Groups.Map())
}

func stateGroups(o *Options) {
	o.Groups = &Groups{Primary: 1, Windows: [][2]int{{0, 0}, {0, 0}}, State: []bool{true, false}}
}

// A state model's G4 hit ends on the last position whose state key the
// bucket holds, found by the lookup even when the block lookup used most
// of the deadline (the state keys get a deadline of their own), and the
// last position loads from its state key. The engine is answered Pending
// until the state keys are asked: the blocks alone (all found first) must
// not end the wait.
func TestStateG4LookupFindsTheLastState(t *testing.T) {
	f := s3test.StartFake(t)
	s := storeAt(t, f.Addr, true)
	prompt := toks(500, 10*bs+1)
	hs := seqHashes(prompt)
	for _, h := range hs {
		require.True(t, s.Enqueue(h, 0, make([]byte, 64)))
	}
	for _, i := range []int{1, 8} { // steps ended at positions 1 and 8
		require.True(t, s.Enqueue(hashing.StateHash(hs[i]), hs[i], make([]byte, 64)))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, s.Flush(ctx))
	require.Len(t, f.Keys("kv-leader"), 12)

	// A fresh leader (another engine): its registry knows nothing. The
	// first block's HEAD takes most of the lookup deadline, every state
	// key's HEAD a good part of it.
	const timeout = 6 * time.Second // margins of 2.4 and 3 s for the requests that do not sleep
	first := s.KeyFor(0, hs[0])
	states := map[string]bool{}
	for _, h := range hs {
		states[s.KeyFor(0, hashing.StateHash(h))] = true
	}
	f.OnHead(func(key string, stored bool) bool {
		switch {
		case key == first:
			time.Sleep(timeout * 6 / 10)
		case states[key]:
			time.Sleep(timeout * 5 / 10)
		}
		return stored
	})
	s2 := storeAt(t, f.Addr, true)
	e := newG4Env(t, 16, &G4Options{Store: s2, Async: true, WriteThrough: true, LookupTimeout: timeout}, stateGroups)
	n := Pending
	deadline := time.Now().Add(30 * time.Second)
	for n == Pending {
		require.True(t, time.Now().Before(deadline), "lookup never finished")
		time.Sleep(5 * time.Millisecond)
		n, _ = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	}
	require.Equal(t, 9*bs, n, "the hit ends on position 8's state: %s", e.logs.String())
	staged := e.l.slots["r"].staged
	require.Len(t, staged, 9)
	require.Equal(t, hashing.StateHash(hs[8]), staged[8].hash)
	require.Equal(t, plan.G4, staged[8].tier)
	require.Equal(t, hs[7], staged[7].hash)
	require.NotContains(t, e.logs.String(), "ran out of time")
	// Asked from the last position backward, one wave (positions 2 to 9)
	// found position 8's state: position 1's was not asked.
	require.False(t, s2.Registry().Contains(hashing.StateHash(hs[1])))
}

// A G4 hit that G2 has too few free blocks to download is cut back to a
// position with a stored state, never to one without (whose state layers
// would load as zeros), and the bounce blocks of the positions dropped are
// free again.
func TestStateG4BounceShortageCutsBackToAState(t *testing.T) {
	s := g4Store(t, nil)
	e := newG4Env(t, 4, &G4Options{Store: s, WriteThrough: true}, stateGroups)
	prompt := toks(600, 6*bs+1)
	hs := seqHashes(prompt)
	for _, h := range hs {
		s.Registry().Add(h)
	}
	s.Registry().Add(hashing.StateHash(hs[2]))
	s.Registry().Add(hashing.StateHash(hs[5]))
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 3*bs, n, "four bounce blocks: cut to position 2, the last with a state before the cut")
	staged := e.l.slots["r"].staged
	require.Equal(t, hashing.StateHash(hs[2]), staged[2].hash)
	require.Equal(t, 1, e.l.host.NumFree(), "three bounce blocks held")
	require.False(t, e.l.RequestFinished("r"))
	require.Equal(t, 4, e.l.host.NumFree())
}
