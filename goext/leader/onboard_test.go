package leader

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/plan"
)

func TestMatchingRule(t *testing.T) {
	tests := []struct {
		name        string
		promptLen   int
		host, disk  []int // blocks of the prompt present in each tier
		numComputed int
		want        int
		wantAsync   bool
		wantTiers   []plan.Tier // tiers of the staged blocks, in order
	}{
		{name: "nothing cached", promptLen: 20, want: 0},
		{name: "G2 prefix", promptLen: 20, host: []int{0, 1, 2}, want: 12, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G2}},
		{name: "G2 then G3 continuation", promptLen: 20, host: []int{0, 1}, disk: []int{2, 3}, want: 16, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G3, plan.G3}},
		{name: "G3 only", promptLen: 20, disk: []int{0, 1}, want: 8, wantAsync: true,
			wantTiers: []plan.Tier{plan.G3, plan.G3}},
		{name: "G2 stops at a gap, later G2 hit unused", promptLen: 20, host: []int{0, 1, 3}, want: 8, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2}},
		{name: "G3 never fills a gap before a G2 hit", promptLen: 20, host: []int{1, 2}, disk: []int{0}, want: 4, wantAsync: true,
			wantTiers: []plan.Tier{plan.G3}},
		{name: "G3 continues once, not back to G2", promptLen: 20, host: []int{0, 1, 3}, disk: []int{2}, want: 12, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G3}},
		{name: "full prompt drops last G2 block", promptLen: 16, host: []int{0, 1, 2, 3}, want: 12, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G2}},
		{name: "full prompt drops from deepest tier", promptLen: 16, host: []int{0, 1}, disk: []int{2, 3}, want: 12, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G3}},
		{name: "full prompt of one block gives nothing", promptLen: 4, host: []int{0}, want: 0},
		{name: "partial tail is never matched, no drop", promptLen: 18, host: []int{0, 1, 2, 3}, want: 16, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G2, plan.G2}},
		{name: "G1 hit: match starts after it", promptLen: 20, host: []int{0, 2, 3}, numComputed: 8, want: 8, wantAsync: true,
			wantTiers: []plan.Tier{plan.G2, plan.G2}},
		{name: "G1 partial hit (unaligned)", promptLen: 20, host: []int{0, 1, 2}, numComputed: 6, want: 0},
		{name: "less than one block beyond G1 hit", promptLen: 18, host: []int{0, 1, 2, 3}, numComputed: 16, want: 0},
		{name: "G1 hit + full-prompt rule", promptLen: 16, host: []int{3}, numComputed: 12, want: 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 16, 16, nil)
			prompt := toks(100, tc.promptLen)
			seed(t, e.l.host, prompt, tc.host...)
			seed(t, e.l.disk, prompt, tc.disk...)
			n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, tc.numComputed)
			require.Equal(t, tc.want, n)
			require.Equal(t, tc.wantAsync, async)
			s := e.l.slots["r"]
			if s == nil {
				require.Nil(t, tc.wantTiers, "rejected before a slot exists")
				return
			}
			var tiers []plan.Tier
			for _, src := range s.staged {
				tiers = append(tiers, src.tier)
				require.Equal(t, 1, e.l.poolOf(src.tier).Info(src.idx).Refs, "staged block pinned once")
			}
			require.Equal(t, tc.wantTiers, tiers)
			hs := seqHashes(prompt)
			for k, src := range s.staged {
				require.Equal(t, hs[tc.numComputed/bs+k], src.hash, "staged in prompt order")
			}
			if len(tc.wantTiers) == 0 {
				return
			}
			// The planned load's tokens by tier (vLLM's per-source hits):
			// nothing before it is planned; block by block after, the last
			// block partial when fewer tokens are asked for.
			h, d, r := e.l.LoadSources("r", n)
			require.Equal(t, [3]int{}, [3]int{h, d, r}, "not planned yet")
			g1 := make([]int64, tc.promptLen/bs+1)
			for i := range g1 {
				g1[i] = int64(40 + i)
			}
			e.l.UpdateStateAfterAlloc("r", g1, n)
			var want [3]int
			for _, tier := range tc.wantTiers {
				want[map[plan.Tier]int{plan.G2: 0, plan.G3: 1}[tier]] += bs
			}
			h, d, r = e.l.LoadSources("r", n)
			require.Equal(t, want, [3]int{h, d, r})
			want[map[plan.Tier]int{plan.G2: 0, plan.G3: 1}[tc.wantTiers[len(tc.wantTiers)-1]]]--
			h, d, r = e.l.LoadSources("r", n-1)
			require.Equal(t, want, [3]int{h, d, r}, "one token less: from the last block's tier")
			h, d, r = e.l.LoadSources("other", n)
			require.Equal(t, [3]int{}, [3]int{h, d, r}, "unknown request")
		})
	}
}

func TestMatchingIdempotent(t *testing.T) {
	e := newEnv(t, 16, 0, nil)
	prompt := toks(0, 20)
	seed(t, e.l.host, prompt, 0, 1, 2)
	for range 3 {
		n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		require.Equal(t, 12, n)
		require.True(t, async)
	}
	for _, src := range e.l.slots["r"].staged {
		require.Equal(t, 1, e.l.host.Info(src.idx).Refs, "no double pin")
	}
	// A call with a G1 hit re-stages from the hit on.
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 4)
	require.Equal(t, 8, n)
	require.Zero(t, e.l.host.Info(0).Refs, "block 0 no longer staged")
	// An unaligned call drops the staging altogether.
	n, _ = e.l.GetNumNewMatchedTokens("r", prompt, 0, 5)
	require.Zero(t, n)
	require.Equal(t, 3, e.l.host.NumInactive())
	n, _ = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 12, n)
	require.False(t, e.l.RequestFinished("r"))
	require.Equal(t, 3, e.l.host.NumInactive(), "finishing unpins everything")
}

func TestMatchingSaltSeparatesRequests(t *testing.T) {
	e := newEnv(t, 16, 0, nil)
	prompt := toks(0, 12)
	seed(t, e.l.host, prompt, 0, 1) // default salt
	n, _ := e.l.GetNumNewMatchedTokens("a", prompt, 12345, 0)
	require.Zero(t, n, "a salted request never sees unsalted blocks")
	n, _ = e.l.GetNumNewMatchedTokens("b", prompt, 0, 0)
	require.Equal(t, 8, n)
}

func TestOnboardPlanning(t *testing.T) {
	e := newEnv(t, 16, 16, nil)
	prompt := toks(0, 22)
	seed(t, e.l.host, prompt, 0, 1)
	seed(t, e.l.disk, prompt, 2, 3)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 16, n)

	g1 := []int64{40, 41, 42, 43, 44, 45}
	e.l.UpdateStateAfterAlloc("r", g1, 16)
	e.l.UpdateStateAfterAlloc("r", g1, 0) // vLLM's second call after the async load
	require.Equal(t, 2.0, val(e.m.OnboardH2D))
	require.Equal(t, 2.0, val(e.m.OnboardD2D))
	require.Equal(t, 16.0, val(e.m.MatchedTokens))

	st := e.step(t)
	require.Equal(t, []plan.Load{{ReqID: "r", Copies: []plan.Copy{
		{Src: plan.G2, SrcBlock: 0, Dst: plan.G1, DstBlock: 40},
		{Src: plan.G2, SrcBlock: 1, Dst: plan.G1, DstBlock: 41},
		{Src: plan.G3, SrcBlock: 0, Dst: plan.G1, DstBlock: 42},
		{Src: plan.G3, SrcBlock: 1, Dst: plan.G1, DstBlock: 43},
	}}}, st.Loads)
	require.Equal(t, 1, e.l.host.Info(0).Refs, "sources pinned while loading")
	require.Empty(t, e.step(t).Loads, "a load is emitted once")

	n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	require.Equal(t, 0, n, "no re-match while the load runs")
	require.False(t, async)

	e.l.LoadsFinished([]string{"r", "unknown"})
	require.Zero(t, e.l.host.Info(0).Refs)
	require.Zero(t, e.l.disk.Info(1).Refs)

	// After the load the engine schedules the request with the loaded tokens
	// computed: nothing of the loaded prefix is saved again.
	st = e.step(t, RequestUpdate{ReqID: "r", NewTokens: prompt, NewBlockIDs: g1, NumComputedTokens: 16, NumScheduledTokens: 6})
	require.Equal(t, []plan.Copy{save(44, plan.G2, 2)}, st.Saves)
}

func TestOnboardAfterG1HitAndPartialAccept(t *testing.T) {
	e := newEnv(t, 16, 0, nil)
	prompt := toks(0, 24)
	seed(t, e.l.host, prompt, 1, 2, 3, 4)
	n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 4)
	require.Equal(t, 16, n)
	// The engine accepts only 8 of the 16 tokens: two blocks load, two are unpinned.
	e.l.UpdateStateAfterAlloc("r", []int64{9, 8, 7, 6, 5, 4}, 8)
	st := e.step(t)
	require.Equal(t, []plan.Copy{
		{Src: plan.G2, SrcBlock: 0, Dst: plan.G1, DstBlock: 8},
		{Src: plan.G2, SrcBlock: 1, Dst: plan.G1, DstBlock: 7},
	}, st.Loads[0].Copies)
	require.Equal(t, 2, e.l.host.NumInactive())
	require.Equal(t, 8.0, val(e.m.MatchedTokens))
}

func TestOnboardDeclinedOrCancelled(t *testing.T) {
	e := newEnv(t, 16, 0, nil)
	prompt := toks(0, 12)
	seed(t, e.l.host, prompt, 0, 1)

	// Declined: 0 external tokens on the first call releases the staging.
	_, _ = e.l.GetNumNewMatchedTokens("a", prompt, 0, 0)
	e.l.UpdateStateAfterAlloc("a", []int64{1, 2, 3}, 0)
	require.Equal(t, 2, e.l.host.NumInactive())
	require.Empty(t, e.step(t).Loads)

	// Planned, then the request is finished before the Step: cancelled.
	_, _ = e.l.GetNumNewMatchedTokens("b", prompt, 0, 0)
	e.l.UpdateStateAfterAlloc("b", []int64{1, 2, 3}, 8)
	require.False(t, e.l.RequestFinished("b"))
	require.Empty(t, e.step(t).Loads)
	require.Equal(t, 2, e.l.host.NumInactive())

	// Planned, then matched again (the engine retried scheduling): re-staged once.
	_, _ = e.l.GetNumNewMatchedTokens("c", prompt, 0, 0)
	e.l.UpdateStateAfterAlloc("c", []int64{1, 2, 3}, 8)
	n, _ := e.l.GetNumNewMatchedTokens("c", prompt, 0, 0)
	require.Equal(t, 8, n)
	e.l.UpdateStateAfterAlloc("c", []int64{4, 5, 6}, 8)
	st := e.step(t)
	require.Len(t, st.Loads, 1)
	require.Equal(t, int64(4), st.Loads[0].Copies[0].DstBlock)
	require.Equal(t, 1, e.l.host.Info(0).Refs)
}

func TestLoadErrorsInvalidateSources(t *testing.T) {
	e := newEnv(t, 16, 16, nil)
	prompt := toks(0, 20)
	seed(t, e.l.host, prompt, 0, 1)
	seed(t, e.l.disk, prompt, 2)
	_, _ = e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
	e.l.UpdateStateAfterAlloc("r", []int64{10, 11, 12, 13, 14}, 12)
	e.step(t)
	e.sink.take()

	e.l.LoadErrors([]int64{12, 99}) // 12 came from G3 block 0; 99 is not ours
	require.Equal(t, 1.0, val(e.m.LoadErrors))
	hs := seqHashes(prompt)
	_, ok := e.l.disk.Lookup(hs[2])
	require.False(t, ok, "a failed source is never served again")
	evs := e.sink.take()
	require.Len(t, evs, 1)
	require.True(t, evs[0].Removed)
	require.Equal(t, hs[2], evs[0].SeqHash)
	require.Equal(t, "KvbmDisk", evs[0].Holder.String())

	e.l.LoadsFinished([]string{"r"})
	require.Zero(t, e.l.host.Info(0).Refs)
	require.Equal(t, 2, e.l.host.NumInactive(), "good G2 sources stay registered")

	st := e.step(t)
	require.Equal(t, []plan.Copy{{Src: plan.G3, SrcBlock: 0}}, st.Drops, "the worker forgets the bad block")
	require.Empty(t, e.step(t).Drops)

	// The engine recomputes; the next match stops before the dropped block.
	n, _ := e.l.GetNumNewMatchedTokens("r2", prompt, 0, 0)
	require.Equal(t, 8, n)
}

func TestLoadErrorOnPinnedBlockDoesNotDropWhileInUse(t *testing.T) {
	e := newEnv(t, 16, 0, nil)
	prompt := toks(0, 12)
	seed(t, e.l.host, prompt, 0, 1)
	// Two requests load the same G2 block; one of them fails.
	for _, id := range []string{"a", "b"} {
		_, _ = e.l.GetNumNewMatchedTokens(id, prompt, 0, 0)
	}
	e.l.UpdateStateAfterAlloc("a", []int64{1, 2, 3}, 8)
	e.l.UpdateStateAfterAlloc("b", []int64{4, 5, 6}, 8)
	e.step(t)
	e.l.LoadErrors([]int64{1})
	require.Equal(t, 1, e.l.host.Info(0).Refs, "b still reads it")
	require.Empty(t, e.step(t).Drops, "no drop while another load reads the block")
	e.l.LoadsFinished([]string{"a", "b"})
	require.Equal(t, 1, e.l.host.NumInactive())
	require.Equal(t, 15, e.l.host.NumFree())
}

// TestLoadFullHit: with LoadFullHit (vLLM), a prompt that ends on a block
// boundary and is cached whole loads every block and leaves the engine only
// its last token; without it (TensorRT-LLM) the last block is recomputed.
func TestLoadFullHit(t *testing.T) {
	for _, tc := range []struct {
		name        string
		promptLen   int
		host, disk  []int
		numComputed int
		want        int
		wantTiers   []plan.Tier
	}{
		{name: "all G2", promptLen: 16, host: []int{0, 1, 2, 3}, want: 15,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G2, plan.G2}},
		{name: "G2 then G3", promptLen: 16, host: []int{0, 1}, disk: []int{2, 3}, want: 15,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G3, plan.G3}},
		{name: "one block", promptLen: 4, host: []int{0}, want: 3, wantTiers: []plan.Tier{plan.G2}},
		{name: "after a G1 hit", promptLen: 16, host: []int{3}, numComputed: 12, want: 3,
			wantTiers: []plan.Tier{plan.G2}},
		{name: "not a full hit: whole blocks", promptLen: 16, host: []int{0, 1, 2}, want: 12,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G2}},
		{name: "partial tail: whole blocks", promptLen: 18, host: []int{0, 1, 2, 3}, want: 16,
			wantTiers: []plan.Tier{plan.G2, plan.G2, plan.G2, plan.G2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnvWith(t, 16, 16, nil, func(o *Options) { o.LoadFullHit = true })
			prompt := toks(100, tc.promptLen)
			seed(t, e.l.host, prompt, tc.host...)
			seed(t, e.l.disk, prompt, tc.disk...)
			n, async := e.l.GetNumNewMatchedTokens("r", prompt, 0, tc.numComputed)
			require.Equal(t, tc.want, n)
			require.True(t, async)
			g1 := make([]int64, (tc.promptLen+bs-1)/bs)
			for i := range g1 {
				g1[i] = int64(100 + i)
			}
			e.l.UpdateStateAfterAlloc("r", g1, n)
			h, d, r := e.l.LoadSources("r", n)
			require.Equal(t, n, h+d+r, "every accepted token has a source")
			st := e.step(t)
			require.Len(t, st.Loads, 1)
			var tiers []plan.Tier
			for k, c := range st.Loads[0].Copies {
				tiers = append(tiers, c.Src)
				require.Equal(t, g1[tc.numComputed/bs+k], c.DstBlock, "block %d loads into its G1 block", k)
			}
			require.Equal(t, tc.wantTiers, tiers, "the last block loads whole")
			require.Equal(t, float64(n), val(e.m.MatchedTokens))
		})
	}
	t.Run("off: the last block is the engine's", func(t *testing.T) {
		e := newEnv(t, 16, 16, nil)
		prompt := toks(100, 16)
		seed(t, e.l.host, prompt, 0, 1, 2, 3)
		n, _ := e.l.GetNumNewMatchedTokens("r", prompt, 0, 0)
		require.Equal(t, 12, n)
	})
}
