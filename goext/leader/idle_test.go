package leader

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/config"
)

const idleTimeout = 10 * time.Minute

func idleOn(c *config.Config) { c.LeaderRequestIdle = idleTimeout }

func (e *env) agedOut() float64 { return val(e.m.RequestsAgedOut()) }

// TestAgeOutIdleRequests: requests the engine never reports finished are
// forgotten once no call has named them for the idle timeout (a matched one
// releases its pins), counted; a request the engine keeps naming stays.
func TestAgeOutIdleRequests(t *testing.T) {
	e := newEnv(t, 16, 0, idleOn)
	prompt := toks(100, 16)
	seed(t, e.l.host, prompt, 0, 1, 2)

	// "staged" matched three G2 blocks (pinned) and was never heard of again;
	// "running" ran a step; "busy" is named every few minutes.
	n, async := e.l.GetNumNewMatchedTokens("staged", prompt, 0, 0)
	require.Equal(t, 12, n)
	require.True(t, async)
	staged := append([]source(nil), e.l.slots["staged"].staged...)
	for _, src := range staged {
		require.Equal(t, 1, e.l.host.Info(src.idx).Refs)
	}
	e.step(t, RequestUpdate{ReqID: "running", NewTokens: toks(500, 6), NewBlockIDs: []int64{1, 2}, NumScheduledTokens: 6},
		RequestUpdate{ReqID: "busy", NewTokens: toks(900, 6), NewBlockIDs: []int64{3, 4}, NumScheduledTokens: 6})
	require.Len(t, e.l.slots, 3)

	for range 3 {
		e.clock.Advance(4 * time.Minute)
		e.step(t, RequestUpdate{ReqID: "busy", NumComputedTokens: 6})
	}
	// 12 minutes in: the two idle requests are gone, the busy one is not.
	require.Len(t, e.l.slots, 1)
	require.Contains(t, e.l.slots, "busy")
	require.Equal(t, 2.0, e.agedOut())
	for _, src := range staged {
		require.Zero(t, e.l.host.Info(src.idx).Refs, "staged pins released")
	}
	require.Equal(t, 16, e.l.host.NumInactive()+e.l.host.NumFree(), "nothing pinned")
	require.Contains(t, e.logs.String(), "request idle too long")

	// Finishing a forgotten request is harmless.
	require.False(t, e.l.RequestFinished("staged"))
	require.Equal(t, 2.0, e.agedOut())

	// Exported under its name.
	fams, err := e.m.Registry.Gather()
	require.NoError(t, err)
	var names []string
	for _, f := range fams {
		names = append(names, f.GetName())
	}
	require.Contains(t, names, "kvbm_requests_aged_out")
}

// TestAgedOutRequestComesBack: a forgotten request is new to the leader.
// An allocation without a new match plans no load (the staged blocks were
// released), a new match stages from scratch, and a step update that only
// continues it offloads nothing (its earlier tokens, which the blocks'
// hashes need, are gone).
func TestAgedOutRequestComesBack(t *testing.T) {
	e := newEnv(t, 16, 0, idleOn)
	prompt := toks(100, 16)
	seed(t, e.l.host, prompt, 0, 1, 2)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 12, n)
	e.step(t, RequestUpdate{ReqID: "c", NewTokens: toks(500, 6), NewBlockIDs: []int64{7, 8}, NumScheduledTokens: 6})
	e.clock.Advance(idleTimeout + time.Second)
	e.step(t)
	require.Empty(t, e.l.slots)
	require.Equal(t, 2.0, e.agedOut())

	// The engine allocates for the old match: no stale plan.
	e.l.UpdateStateAfterAlloc("r", []int64{10, 11, 12, 13}, 12)
	st := e.step(t)
	require.Empty(t, st.Loads)

	// Matched again: staged and loaded as for any new request.
	n, _ = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 12, n)
	e.l.UpdateStateAfterAlloc("r", []int64{10, 11, 12, 13}, 12)
	st = e.step(t)
	require.Len(t, st.Loads, 1)
	require.Len(t, st.Loads[0].Copies, 3)

	// "c" continues: one new token, 6 computed before. Its hashes would be
	// those of the wrong tokens: nothing is saved, now or later.
	registered := e.l.host.NumRegistered()
	st = e.step(t, RequestUpdate{ReqID: "c", NewTokens: toks(506, 1), NewBlockIDs: []int64{9}, NumComputedTokens: 6, NumScheduledTokens: 1})
	require.Empty(t, st.Saves)
	for k := range 12 {
		st = e.step(t, RequestUpdate{ReqID: "c", NewTokens: toks(507+k, 1), NumComputedTokens: 7 + k, NumScheduledTokens: 1})
		require.Empty(t, st.Saves)
	}
	require.Equal(t, registered, e.l.host.NumRegistered())
	require.True(t, e.l.slots["c"].stopped)

	// A resumed request sends all its tokens: offloaded as usual.
	all := toks(700, 8)
	st = e.step(t, RequestUpdate{ReqID: "c2", NewTokens: all, NewBlockIDs: []int64{20, 21}, NumScheduledTokens: 8, Resumed: true})
	require.Len(t, st.Saves, 2)
}

// TestAgeOutKeepsRunningLoads: a request whose load is with the workers is
// not forgotten (only their report releases the sources); once the load
// finished, it ages out like any other.
func TestAgeOutKeepsRunningLoads(t *testing.T) {
	e := newEnv(t, 16, 0, idleOn)
	prompt := toks(100, 16)
	seed(t, e.l.host, prompt, 0, 1, 2)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 12, n)
	e.l.UpdateStateAfterAlloc("r", []int64{10, 11, 12, 13}, 12)
	st := e.step(t)
	require.Len(t, st.Loads, 1)

	e.clock.Advance(2 * idleTimeout)
	e.step(t)
	require.Contains(t, e.l.slots, "r")
	require.Zero(t, e.agedOut())
	for _, c := range st.Loads[0].Copies {
		require.Equal(t, 1, e.l.host.Info(int(c.SrcBlock)).Refs, "load source still pinned")
	}

	e.l.LoadsFinished([]string{"r"})
	for _, c := range st.Loads[0].Copies {
		require.Zero(t, e.l.host.Info(int(c.SrcBlock)).Refs)
	}
	e.clock.Advance(idleTimeout - time.Second)
	e.step(t)
	require.Contains(t, e.l.slots, "r", "LoadsFinished counts as a call")
	e.clock.Advance(2 * time.Second)
	e.step(t)
	require.NotContains(t, e.l.slots, "r")
	require.Equal(t, 1.0, e.agedOut())
}

// TestIdleListOrder: touching moves a slot to the newest end, forgetting
// unlinks it, and the list stays consistent through reuse of spare slots.
func TestIdleListOrder(t *testing.T) {
	e := newEnv(t, 16, 0, idleOn)
	ids := []string{"a", "b", "c", "d"}
	for _, id := range ids {
		e.l.GetNumNewMatchedTokens(id, toks(0, 8), 0, 0)
		e.clock.Advance(time.Minute)
	}
	e.l.GetNumNewMatchedTokens("b", toks(0, 8), 0, 0) // b is the newest now
	e.l.RequestFinished("c")
	order := func() (out []string) {
		for s := e.l.idle.oldest; s != nil; s = s.newer {
			out = append(out, s.id)
		}
		var back []string
		for s := e.l.idle.newest; s != nil; s = s.older {
			back = append([]string{s.id}, back...)
		}
		require.Equal(t, out, back, "both directions agree")
		return out
	}
	require.Equal(t, []string{"a", "d", "b"}, order())
	e.l.GetNumNewMatchedTokens("e", toks(0, 8), 0, 0) // reuses c's slot
	require.Equal(t, []string{"a", "d", "b", "e"}, order())
	e.clock.Advance(idleTimeout - 2*time.Minute) // a, at 0, is 12 min old; d, at 3, 9
	e.step(t)
	require.Equal(t, []string{"d", "b", "e"}, order())
	require.Equal(t, 1.0, e.agedOut())
}
