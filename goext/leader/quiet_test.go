package leader

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStepNeeded: the leader waits for a step exactly while it has queued
// work a step would carry, and the published word follows every change,
// including those made outside Step (a match's planned load, a purge's
// drops).
func TestStepNeeded(t *testing.T) {
	e := newEnv(t, 16, 16, filterOff)
	var w atomic.Int64
	w.Store(-1)
	e.l.PublishStepNeeded(&w)
	word := func() bool {
		t.Helper()
		v := w.Load()
		require.Contains(t, []int64{0, 1}, v)
		require.Equal(t, e.l.StepNeeded(), v == 1, "the word follows StepNeeded")
		return v == 1
	}
	require.False(t, word(), "a fresh leader waits for nothing")

	// A prefill that saves two blocks to G2: their G2→G3 moves are queued
	// for the next step.
	p := toks(100, 9)
	e.step(t, RequestUpdate{ReqID: "a", NewTokens: p, NewBlockIDs: []int64{1, 2, 3}, NumScheduledTokens: 9})
	require.True(t, word(), "moves queued for the next step")
	st := e.step(t, RequestUpdate{ReqID: "a", NumComputedTokens: 9, NumScheduledTokens: 1})
	require.Len(t, st.Moves, 2)
	require.False(t, word(), "moves planned, nothing queued")

	// A quiet decode step changes nothing when it is finally sent with its
	// tokens: the block completed in a later step is saved as usual.
	st = e.step(t, RequestUpdate{ReqID: "a", NewTokens: []uint32{7, 8, 9}, NumComputedTokens: 11, NumScheduledTokens: 1})
	require.Equal(t, 1, len(st.Saves), "block 2 (tokens 8..11) saved")
	require.True(t, word())
	e.step(t)
	require.False(t, word())

	// A match that plans a load: the load goes out with the next step.
	n, _ := e.l.GetNumNewMatchedTokens("b", append(append([]uint32{}, p...), 7, 8, 9, 1000), 0, 0)
	require.Equal(t, 12, n)
	e.l.UpdateStateAfterAlloc("b", []int64{4, 5, 6}, n)
	require.True(t, word(), "a planned load waits for a step")
	st = e.step(t)
	require.Len(t, st.Loads, 1)
	require.False(t, word())

	// A purge (from the operator socket, outside any step): its drops.
	_, err := e.l.Purge(context.Background(), PurgeRequest{All: true})
	require.NoError(t, err)
	require.True(t, word(), "drops wait for a step")
	st = e.step(t)
	require.NotEmpty(t, st.Drops)
	require.False(t, word())
}

// TestStepNeededWhileASaveWaitsForABlock: a save that found its tier full
// of pinned blocks is retried in the next step, so that step is needed.
func TestStepNeededWhileASaveWaitsForABlock(t *testing.T) {
	e := newEnv(t, 1, 0, nil)
	seed(t, e.l.host, toks(0, 4), 0)
	_, _ = e.l.GetNumNewMatchedTokens("x", toks(0, 8), 0, 0) // pins the only block
	st := e.step(t, RequestUpdate{ReqID: "a", NewTokens: toks(100, 4), NewBlockIDs: []int64{1}, NumScheduledTokens: 4})
	require.Empty(t, st.Saves)
	require.True(t, e.l.StepNeeded(), "the save is retried next step")
	e.l.RequestFinished("x")
	st = e.step(t, RequestUpdate{ReqID: "a", NewTokens: []uint32{7}, NumComputedTokens: 4, NumScheduledTokens: 1})
	require.Equal(t, 1, len(st.Saves), "retried once a block is free")
	require.False(t, e.l.StepNeeded())
}
