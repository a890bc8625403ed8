package leader

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
	"github.com/kvbm/kvbm/goext/events"
	"github.com/kvbm/kvbm/goext/plan"
	"github.com/kvbm/kvbm/goext/pool"
)

// newBgEnv: host/disk of 16 blocks, filter off, background mode, and a
// request "a" of two full blocks saved to G2 blocks 0 and 1 in step 1.
func newBgEnv(t *testing.T) (*env, []uint64) {
	t.Helper()
	e := newEnv(t, 16, 16, func(c *config.Config) { c.DisableDiskOffloadFilter = true })
	e.l.bgMode = true
	st := e.step(t, RequestUpdate{ReqID: "a", NewTokens: toks(0, 8), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	require.Len(t, st.Saves, 2)
	e.sink.take()
	return e, seqHashes(toks(0, 8))
}

func (e *env) planBg(t *testing.T) (*plan.Step, uint64) {
	t.Helper()
	b, ticket, err := e.l.PlanBackground()
	require.NoError(t, err)
	if b == nil {
		require.Zero(t, ticket)
		return nil, 0
	}
	st, err := plan.Decode(b)
	require.NoError(t, err)
	return st, ticket
}

func diskEvents(evs []events.BlockEvent) (stored, removed []uint64) {
	for _, ev := range evs {
		if ev.Holder != events.HolderKvbmDisk {
			continue
		}
		if ev.Removed {
			removed = append(removed, ev.SeqHash)
		} else {
			stored = append(stored, ev.SeqHash)
		}
	}
	return stored, removed
}

func TestBackgroundMovesLeaveTheStepPlans(t *testing.T) {
	e, _ := newBgEnv(t)
	require.Empty(t, e.step(t).Moves, "background mode: no moves in step plans")
	st, ticket := e.planBg(t)
	require.NotZero(t, ticket)
	require.Equal(t, uint64(2), st.Seq, "runs after the last planned engine step's saves")
	require.Equal(t, []plan.Copy{
		{Src: plan.G2, SrcBlock: 0, Dst: plan.G3, DstBlock: 0},
		{Src: plan.G2, SrcBlock: 1, Dst: plan.G3, DstBlock: 1},
	}, st.Moves)
	require.Empty(t, st.Saves)
	require.Empty(t, st.Loads)
	require.Equal(t, 1, e.l.BackgroundInFlight())
	again, _ := e.planBg(t)
	require.Nil(t, again, "queued moves were taken; an open ticket's hashes are not planned twice")
	require.NoError(t, e.l.CommitBackground(ticket, true))
	require.Zero(t, e.l.BackgroundInFlight())

	// Default (off): PlanBackground has nothing, moves stay in step plans.
	d := newEnv(t, 16, 16, func(c *config.Config) { c.DisableDiskOffloadFilter = true })
	d.step(t, RequestUpdate{ReqID: "a", NewTokens: toks(0, 8), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	st, _ = d.planBg(t)
	require.Nil(t, st)
	require.Len(t, d.step(t).Moves, 2)
}

func TestBackgroundCommit(t *testing.T) {
	tests := []struct {
		name string
		// commits is the outcome of each planned operation in turn (the
		// moves of a failed one are retried by the next).
		commits       []bool
		resetBefore   bool // ResetCache between the last plan and its commit
		wantInDisk    bool
		wantStored    int // G3 store events over the whole run
		wantOffloaded float64
		wantRequeued  bool // another PlanBackground afterwards has the moves
	}{
		{name: "every rank acked", commits: []bool{true}, wantInDisk: true, wantStored: 2, wantOffloaded: 2},
		{name: "failed then retried", commits: []bool{false, true}, wantInDisk: true, wantStored: 2, wantOffloaded: 2},
		{name: "failed once", commits: []bool{false}, wantRequeued: true},
		{name: "failed every attempt", commits: []bool{false, false, false}},
		{name: "cache reset while in flight", commits: []bool{true}, resetBefore: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, hs := newBgEnv(t)
			var stored []uint64
			for i, ok := range tc.commits {
				st, ticket := e.planBg(t)
				require.NotNil(t, st, "operation %d", i)
				require.Len(t, st.Moves, 2)
				// In flight: sources pinned, destinations allocated but not findable.
				for _, c := range st.Moves {
					require.Equal(t, pool.Allocated, e.l.disk.Info(int(c.DstBlock)).State)
					require.Positive(t, e.l.host.Info(int(c.SrcBlock)).Refs)
				}
				_, found := e.l.disk.Lookup(hs[0])
				require.False(t, found, "not in G3 before every rank acked")
				s, _ := diskEvents(e.sink.take())
				require.Empty(t, s, "nothing announced before every rank acked")
				if tc.resetBefore && i == len(tc.commits)-1 {
					e.l.ResetCache()
					e.sink.take()
				}
				require.NoError(t, e.l.CommitBackground(ticket, ok))
				s, _ = diskEvents(e.sink.take())
				stored = append(stored, s...)
				for _, c := range st.Moves {
					require.Zero(t, e.l.host.Info(int(c.SrcBlock)).Refs, "sources unpinned at commit")
				}
			}
			require.Len(t, stored, tc.wantStored)
			if tc.wantStored > 0 {
				require.Equal(t, hs, stored)
			}
			_, inDisk := e.l.disk.Lookup(hs[1])
			require.Equal(t, tc.wantInDisk, inDisk)
			require.Equal(t, tc.wantOffloaded, val(e.m.OffloadH2D))
			if tc.wantInDisk {
				require.Equal(t, 2, e.l.disk.NumRegistered())
				require.Equal(t, 2.0, val(e.m.DiskBlocksUsed))
			} else {
				require.Zero(t, e.l.disk.NumRegistered())
				require.Equal(t, 16, e.l.disk.NumFree(), "failed destinations went back to the free list")
			}
			st, _ := e.planBg(t)
			require.Equal(t, tc.wantRequeued, st != nil)
		})
	}
}

func TestBackgroundMatchAfterCommitAndPins(t *testing.T) {
	// G2 of 2 blocks: an open ticket pins both, so a step's save finds no
	// G2 block; after the commit the blocks are matchable from G3.
	e := newEnv(t, 2, 8, func(c *config.Config) { c.DisableDiskOffloadFilter = true })
	e.l.bgMode = true
	prompt := toks(0, 8)
	e.step(t, RequestUpdate{ReqID: "a", NewTokens: prompt, NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 8})
	st, ticket := e.planBg(t)
	require.Len(t, st.Moves, 2)
	require.Empty(t, e.step(t, RequestUpdate{ReqID: "b", NewTokens: toks(100, 4), NewBlockIDs: []int64{3}, NumScheduledTokens: 4}).Saves,
		"both G2 blocks are sources of an open background operation")
	require.NoError(t, e.l.CommitBackground(ticket, true))
	require.ErrorContains(t, e.l.CommitBackground(ticket, true), "unknown background ticket")

	// Evict G2 (new prompts take both blocks): the prefix now comes from G3.
	e.step(t, RequestUpdate{ReqID: "c", NewTokens: toks(200, 8), NewBlockIDs: []int64{4, 5}, NumScheduledTokens: 8})
	n, async := e.l.GetNumNewMatchedTokens("d", append(prompt, 1), 0, 0)
	require.Equal(t, 8, n)
	require.True(t, async)
	e.l.UpdateStateAfterAlloc("d", []int64{6, 7, 8}, 8)
	st = e.step(t)
	require.Len(t, st.Loads, 1)
	for _, c := range st.Loads[0].Copies {
		require.Equal(t, plan.G3, c.Src)
	}
}

func TestSetDegraded(t *testing.T) {
	prompt := toks(0, 12)
	tests := []struct {
		name  string
		check func(t *testing.T, e *env)
	}{
		{"matching stops", func(t *testing.T, e *env) {
			n, async := e.l.GetNumNewMatchedTokens("b", prompt, 0, 0)
			require.Zero(t, n)
			require.False(t, async)
		}},
		{"no saves or moves", func(t *testing.T, e *env) {
			st := e.step(t, RequestUpdate{ReqID: "c", NewTokens: toks(500, 8), NewBlockIDs: []int64{7, 8}, NumScheduledTokens: 8})
			require.Empty(t, st.Saves)
			require.Empty(t, st.Moves)
			require.Empty(t, e.step(t).Moves)
		}},
		{"no background operations", func(t *testing.T, e *env) {
			e.l.bgMode = true
			st, _ := e.planBg(t)
			require.Nil(t, st)
		}},
		{"a load already promised still goes out", func(t *testing.T, e *env) {
			st := e.step(t)
			require.Len(t, st.Loads, 1)
			require.Equal(t, "p", st.Loads[0].ReqID)
		}},
		{"logged once per set of ranks", func(t *testing.T, e *env) {
			e.l.SetDegraded([]int{1, 1})
			e.l.SetDegraded(nil)
			require.Equal(t, 1, strings.Count(e.logs.String(), "dead_ranks=[1]"), e.logs.String())
			e.l.SetDegraded([]int{3, 1})
			require.Equal(t, 1, strings.Count(e.logs.String(), "dead_ranks=\"[1 3]\""), e.logs.String())
			deg, ranks := e.l.Degraded()
			require.True(t, deg)
			require.Equal(t, []int{1, 3}, ranks)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 16, 16, func(c *config.Config) { c.DisableDiskOffloadFilter = true })
			e.step(t, RequestUpdate{ReqID: "a", NewTokens: prompt, NewBlockIDs: []int64{1, 2, 3}, NumScheduledTokens: 12})
			// A load matched and accepted before the rank died.
			n, _ := e.l.GetNumNewMatchedTokens("p", prompt, 0, 0)
			require.Equal(t, 8, n)
			e.l.UpdateStateAfterAlloc("p", []int64{4, 5, 6}, 8)
			deg, _ := e.l.Degraded()
			require.False(t, deg)
			e.l.SetDegraded([]int{1})
			tc.check(t, e)
		})
	}
}

func TestDegradedFailsOpenTicketsForGood(t *testing.T) {
	e, hs := newBgEnv(t)
	_, ticket := e.planBg(t)
	e.l.SetDegraded([]int{0})
	require.NoError(t, e.l.CommitBackground(ticket, false))
	_, found := e.l.disk.Lookup(hs[0])
	require.False(t, found)
	require.Equal(t, 16, e.l.disk.NumFree())
	require.Zero(t, e.l.host.Info(0).Refs)
	e.l.bgMode = true
	st, _ := e.planBg(t)
	require.Nil(t, st, "failed moves are not requeued once degraded")
}
