package policy

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/plan"
)

// tiers builds a match: g2 G2 blocks, then g3 G3 blocks, then g4 G4 blocks.
func tiers(g2, g3, g4 int) []plan.Tier {
	var ts []plan.Tier
	for range g2 {
		ts = append(ts, plan.G2)
	}
	for range g3 {
		ts = append(ts, plan.G3)
	}
	for range g4 {
		ts = append(ts, plan.G4)
	}
	return ts
}

// trained is a model whose tiers cost exactly what is given (many equal
// measurements at two sizes) and whose prefill is configured.
func trained(t *testing.T, usPerToken float64, costs map[plan.Tier]TierCost) *Model {
	t.Helper()
	m := NewModel(usPerToken)
	for tier, c := range costs {
		for i := range 400 {
			mb := float64(1 + i%2*7)
			m.ObserveLoad(tier, int64(mb*1e6), time.Duration(c.Seconds(mb)*1e9))
		}
	}
	return m
}

var shape = Shape{BlockTokens: 16, MBPerBlock: 1} // one batch

func TestDecideAlwaysLoadsEverything(t *testing.T) {
	m := trained(t, 1, map[plan.Tier]TierCost{plan.G4: {Latency: time.Second}})
	d := m.Decide(LoadPolicy{Mode: Always}, tiers(2, 2, 2), shape)
	require.Equal(t, 6, d.Load)
	require.Equal(t, [3]int{}, d.Skipped)
	require.Empty(t, d.Reason)
	require.Equal(t, d.LoadAll, d.LoadChosen)
}

// 16 tokens at 100 µs = 1.6 ms a block to compute. G2: 0.1 ms a block; a
// slow G4 (100 ms per load) is left to the engine, the G2 prefix kept.
func TestDecideCostSkipsASlowTier(t *testing.T) {
	m := trained(t, 100, map[plan.Tier]TierCost{
		plan.G2: {Latency: 10 * time.Microsecond, SecondsPerMB: 1e-4},
		plan.G4: {Latency: 100 * time.Millisecond, SecondsPerMB: 1e-3},
	})
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(4, 0, 10), shape)
	require.Equal(t, 4, d.Load)
	require.Equal(t, [3]int{0, 0, 10}, d.Skipped)
	require.Equal(t, ReasonSlower, d.Reason)
	require.Less(t, d.LoadChosen, d.LoadAll)
	require.InDelta(t, 14*16*100e-6, d.RecomputeAll, 1e-9)

	// The same G4 with a long enough match repays its latency: 400 blocks
	// compute in 640 ms and load in 100 ms + 400 ms of G4 bytes + 40 ms of
	// G2 hops.
	d = m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 400), shape)
	require.Equal(t, 400, d.Load)
	require.Empty(t, d.Reason)
}

// A fast G4 (2 ms per load) beats recomputing 10 blocks (16 ms).
func TestDecideCostLoadsAFastTier(t *testing.T) {
	m := trained(t, 100, map[plan.Tier]TierCost{
		plan.G2: {Latency: 10 * time.Microsecond, SecondsPerMB: 1e-4},
		plan.G4: {Latency: 2 * time.Millisecond, SecondsPerMB: 1e-4},
	})
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(4, 0, 10), shape)
	require.Equal(t, 14, d.Load)
	require.Equal(t, [3]int{}, d.Skipped)
}

// A G3 tail too short to repay the tier's latency is skipped; a long one
// is loaded.
func TestDecideCostG3NeedsEnoughBlocks(t *testing.T) {
	m := trained(t, 100, map[plan.Tier]TierCost{
		plan.G2: {Latency: 10 * time.Microsecond, SecondsPerMB: 1e-4},
		plan.G3: {Latency: 5 * time.Millisecond, SecondsPerMB: 1e-3}, // 1 ms a block
	})
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(2, 3, 0), shape) // 3 G3 blocks: 8 ms vs 4.8 ms
	require.Equal(t, 2, d.Load)
	require.Equal(t, [3]int{0, 3, 0}, d.Skipped)
	d = m.Decide(LoadPolicy{Mode: Cost}, tiers(2, 20, 0), shape) // 25 ms vs 32 ms
	require.Equal(t, 22, d.Load)
	// Nothing pays: recompute all.
	slow := trained(t, 1, map[plan.Tier]TierCost{plan.G2: {Latency: time.Millisecond, SecondsPerMB: 1e-3}})
	d = slow.Decide(LoadPolicy{Mode: Cost}, tiers(3, 0, 0), shape)
	require.Equal(t, 0, d.Load)
	require.Equal(t, [3]int{3, 0, 0}, d.Skipped)
}

// Batches run Concurrency at a time: 64 G3 blocks in batches of 16, 4 at a
// time, cost one batch's time.
func TestDecideCountsParallelBatches(t *testing.T) {
	m := trained(t, 100, map[plan.Tier]TierCost{plan.G3: {Latency: time.Millisecond, SecondsPerMB: 1e-3}})
	serial := m.Decide(LoadPolicy{Mode: Always}, tiers(0, 64, 0), shape)
	perBlock := m.Decide(LoadPolicy{Mode: Always}, tiers(0, 64, 0), Shape{BlockTokens: 16, MBPerBlock: 1, BatchBlocks: 1})
	par := m.Decide(LoadPolicy{Mode: Always}, tiers(0, 64, 0),
		Shape{BlockTokens: 16, MBPerBlock: 1, BatchBlocks: 16, Concurrency: 4})
	require.InEpsilon(t, 1e-3+64e-3, serial.LoadAll, 0.01) // the prior keeps 1%
	require.InEpsilon(t, 1e-3+16e-3, par.LoadAll, 0.01)
	require.InEpsilon(t, 64*(1e-3+1e-3), perBlock.LoadAll, 0.02)
}

func TestDecideCap(t *testing.T) {
	m := trained(t, 100, map[plan.Tier]TierCost{
		plan.G2: {Latency: 0, SecondsPerMB: 1e-3}, // 1 ms a block
		plan.G3: {Latency: 0, SecondsPerMB: 1e-3},
	})
	p, err := NewLoadPolicy("never-slower-than", 5.5)
	require.NoError(t, err)
	d := m.Decide(p, tiers(3, 5, 0), shape)
	require.Equal(t, 5, d.Load)
	require.Equal(t, [3]int{0, 3, 0}, d.Skipped)
	require.Equal(t, ReasonOverCap, d.Reason)
	require.LessOrEqual(t, d.LoadChosen, 5.5e-3)
}

func TestNewLoadPolicy(t *testing.T) {
	for _, tc := range []struct {
		mode string
		ms   float64
		want LoadPolicy
	}{
		{"", 0, LoadPolicy{Mode: Always}},
		{"always", 0, LoadPolicy{Mode: Always}},
		{"cost", 0, LoadPolicy{Mode: Cost}},
		{"never-slower-than", 20, LoadPolicy{Mode: Cap, Cap: 20 * time.Millisecond}},
	} {
		p, err := NewLoadPolicy(tc.mode, tc.ms)
		require.NoError(t, err)
		require.Equal(t, tc.want, p)
	}
	_, err := NewLoadPolicy("never-slower-than", 0)
	require.ErrorContains(t, err, "policy: never-slower-than needs a positive bound")
	_, err = NewLoadPolicy("fastest", 0)
	require.ErrorContains(t, err, `policy: unknown load policy "fastest"`)
	require.Equal(t, "cost", Cost.String())
}

// A tier never measured is loaded under Cost (measuring it is the only way
// to learn it); one skipped since its last measurement is loaded once more
// after ExploreFirst skips, then after twice as many each time the
// exploration did not make it worth loading, up to ExploreEvery; a tier
// worth loading again starts the schedule over.
func TestDecideCostExplores(t *testing.T) {
	m := NewModel(1) // 1 µs a token: by the priors nothing from G4 pays
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), shape)
	require.True(t, d.Explored)
	require.Equal(t, 4, d.Load)
	require.Empty(t, d.Reason)

	skipsBeforeExploring := func() int {
		m.ObserveLoad(plan.G4, 1e6, 50*time.Millisecond) // the exploration's load: still too slow
		for k := 0; ; k++ {
			d := m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), shape)
			if d.Explored {
				require.Equal(t, 4, d.Load)
				return k
			}
			require.Equal(t, 0, d.Load)
			require.Equal(t, [3]int{0, 0, 4}, d.Skipped)
		}
	}
	var gaps []int
	for range 6 {
		gaps = append(gaps, skipsBeforeExploring())
	}
	require.Equal(t, []int{ExploreFirst, 2 * ExploreFirst, 4 * ExploreFirst, 8 * ExploreFirst, ExploreEvery, ExploreEvery}, gaps)

	// Fast again: loaded on its estimate, and the schedule starts over.
	for range 40 {
		m.ObserveLoad(plan.G4, 1e6, time.Microsecond)
	}
	m.fixed = 1e-3 // and recomputing got dearer: 1 ms a token
	d = m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), shape)
	require.False(t, d.Explored)
	require.Equal(t, 4, d.Load)
	require.Zero(t, m.explored[2])
	// The bound is the operator's: no exploration past it.
	d = NewModel(1).Decide(LoadPolicy{Mode: Cap, Cap: time.Millisecond}, tiers(0, 0, 4), shape)
	require.False(t, d.Explored)
	require.Equal(t, 0, d.Load)
}

// Shape.Overhead (a G4 lookup still to make) is paid by any load: it turns
// a G4 prefix that pays for itself into one that does not, and counts
// toward never-slower-than's bound.
func TestDecideOverhead(t *testing.T) {
	m := NewModel(1000) // 1 ms per token
	m.ObserveLoad(plan.G4, 0, 10*time.Millisecond)
	sh := Shape{BlockTokens: 32, MBPerBlock: 0.01}
	tiers := []plan.Tier{plan.G4, plan.G4, plan.G4, plan.G4} // recompute: 128 ms; load: about 12 ms
	require.Equal(t, 4, m.Decide(LoadPolicy{Mode: Cost}, tiers, sh).Load)
	sh.Overhead = 0.5
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers, sh)
	require.Zero(t, d.Load)
	require.Equal(t, [3]int{0, 0, 4}, d.Skipped)
	sh.Overhead = 0.05
	require.Zero(t, m.Decide(LoadPolicy{Mode: Cap, Cap: 40 * time.Millisecond}, tiers, sh).Load)
	sh.Overhead = 0
	require.Equal(t, 4, m.Decide(LoadPolicy{Mode: Cap, Cap: 40 * time.Millisecond}, tiers, sh).Load)
}

// LookupWaves counts the HEAD waves object.Store.LookupSalted issues for a
// full hit: the first block alone, then the rest concurrency at a time.
func TestLookupWaves(t *testing.T) {
	for _, c := range []struct{ n, conc, want int }{
		{0, 32, 0}, {1, 32, 1}, {2, 32, 2}, {12, 32, 2}, {33, 32, 2}, {34, 32, 3}, {12, 4, 4}, {12, 0, 2}, {1, 0, 1},
	} {
		require.Equal(t, c.want, LookupWaves(c.n, c.conc), "n=%d concurrency=%d", c.n, c.conc)
	}
}

// ObserveLookup keeps a decayed mean of one wave's time: a lookup that
// stopped after its first (missing) block measures one round trip, and a
// 12-block lookup is then expected to take two (the first block, then the
// other 11 side by side); before any lookup it is 0.
func TestObserveLookup(t *testing.T) {
	m := NewModel(0)
	require.Zero(t, m.LookupSeconds(12, 32))
	m.ObserveLookup(100*time.Millisecond, 1) // a miss: one HEAD
	require.InDelta(t, 0.1, m.LookupSeconds(1, 32), 1e-9)
	require.InDelta(t, 0.2, m.LookupSeconds(12, 32), 1e-9)
	require.InDelta(t, 0.3, m.LookupSeconds(34, 32), 1e-9)
	m.ObserveLookup(400*time.Millisecond, 2) // a hit: two waves of 200 ms
	require.InDelta(t, 0.1, m.LookupSeconds(1, 32), 1e-9, "the least of the recent round trips")
	m.ObserveLookup(-time.Second, 1)
	m.ObserveLookup(time.Second, 0)
	require.InDelta(t, 0.1, m.LookupSeconds(1, 32), 1e-9)
	// A slower bucket is followed within recentN lookups.
	for range recentN {
		m.ObserveLookup(300*time.Millisecond, 1)
	}
	require.InDelta(t, 0.3, m.LookupSeconds(1, 32), 1e-9)
}

// One stalled measurement (the first lookup's cold connection, a load that
// waited on a busy host) does not keep a fast tier off: the bounds are the
// least of the recent measurements, so the next normal one brings them
// back, and the exploration that takes it comes after ExploreFirst skips.
func TestDecideRecoversFromAStall(t *testing.T) {
	m := trained(t, 1000, map[plan.Tier]TierCost{ // 1 ms a token: 4 blocks of 32 = 128 ms
		plan.G2: {Latency: 10 * time.Microsecond, SecondsPerMB: 1e-5},
		plan.G3: {Latency: time.Millisecond, SecondsPerMB: 1e-4},
		plan.G4: {Latency: time.Millisecond, SecondsPerMB: 1e-4},
	})
	sh := Shape{BlockTokens: 32, MBPerBlock: 0.01}
	m.ObserveEndToEnd(plan.G4, 40_000, 900*time.Millisecond) // stalled
	skipped := 0
	for m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), sh).Load == 0 {
		skipped++
		require.Less(t, skipped, ExploreEvery)
	}
	require.Equal(t, ExploreFirst, skipped, "explored again after ExploreFirst skips")
	m.ObserveLoad(plan.G4, 40_000, 5*time.Millisecond)
	m.ObserveEndToEnd(plan.G4, 40_000, 30*time.Millisecond) // the exploration: normal
	e, ok := m.EndToEnd(plan.G4, 0.04)
	require.True(t, ok)
	require.Less(t, e, 0.05)
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), sh)
	require.False(t, d.Explored)
	require.Equal(t, 4, d.Load, "loaded on its estimate again")

	// A tier that is slow every time stays skipped (each exploration
	// measures it slow again).
	for range recentN {
		m.ObserveEndToEnd(plan.G4, 40_000, 900*time.Millisecond)
	}
	require.Zero(t, m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), sh).Load)
}

// What loading requests of a tier were seen to wait end to end bounds the
// expected load from below: a G4 whose downloads alone are fast, but whose
// loading requests waited 300 ms, loses against 128 ms of recompute; a G2
// prefix is not affected by G3's end-to-end wait.
func TestDecideEndToEnd(t *testing.T) {
	m := trained(t, 1000, map[plan.Tier]TierCost{ // 1 ms a token: 4 blocks of 32 = 128 ms
		plan.G2: {Latency: 10 * time.Microsecond, SecondsPerMB: 1e-5},
		plan.G3: {Latency: time.Millisecond, SecondsPerMB: 1e-4},
		plan.G4: {Latency: time.Millisecond, SecondsPerMB: 1e-4},
	})
	sh := Shape{BlockTokens: 32, MBPerBlock: 0.01}
	_, ok := m.EndToEnd(plan.G4, 0.04)
	require.False(t, ok)
	require.Equal(t, 4, m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), sh).Load)
	m.ObserveEndToEnd(plan.G4, 40_000, 300*time.Millisecond)
	e, ok := m.EndToEnd(plan.G4, 0.04)
	require.True(t, ok)
	require.InDelta(t, 0.3, e, 1e-9)
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 4), sh)
	require.Zero(t, d.Load)
	require.InDelta(t, 0.3, d.LoadAll, 1e-9)
	require.Zero(t, m.Decide(LoadPolicy{Mode: Cap, Cap: 200 * time.Millisecond}, tiers(0, 0, 4), sh).Load)

	m.ObserveEndToEnd(plan.G3, 40_000, 300*time.Millisecond)
	d = m.Decide(LoadPolicy{Mode: Cost}, tiers(2, 2, 0), sh)
	require.Equal(t, 2, d.Load, "the G2 prefix still loads")
	require.Equal(t, [3]int{0, 2, 0}, d.Skipped)
	// G2 is not timed end to end; bad input is ignored.
	m.ObserveEndToEnd(plan.G2, 40_000, time.Second)
	m.ObserveEndToEnd(plan.G4, 0, time.Second)
	m.ObserveEndToEnd(plan.G4, 40_000, -time.Second)
	_, ok = m.EndToEnd(plan.G2, 0.04)
	require.False(t, ok)
	e, _ = m.EndToEnd(plan.G4, 0.04)
	require.InDelta(t, 0.3, e, 1e-9)
}

// G4 downloads run DownloadWave blocks at a time, each wave paying the
// request latency: 20 blocks take two waves, so only the first 16 (one
// wave) pay for themselves; the fit is per wave, so a two-wave load
// measures the same latency as a one-wave load.
func TestDecideDownloadWaves(t *testing.T) {
	m := trained(t, 120, map[plan.Tier]TierCost{ // 120 µs a token: 32 tokens a block, 3.84 ms
		plan.G2: {Latency: 0, SecondsPerMB: 1e-6},
		plan.G4: {Latency: 50 * time.Millisecond, SecondsPerMB: 1e-6},
	})
	sh := Shape{BlockTokens: 32, MBPerBlock: 0.01}
	require.Equal(t, 20, m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 20), sh).Load)
	m.SetDownloadWave(16, 0.01)
	d := m.Decide(LoadPolicy{Mode: Cost}, tiers(0, 0, 20), sh)
	require.Equal(t, 16, d.Load)
	require.InDelta(t, 0.1, d.LoadAll, 3e-3)

	f := NewModel(100)
	f.SetDownloadWave(16, 1) // 1 MB a block
	for i := range 400 {
		if i%2 == 0 {
			f.ObserveLoad(plan.G4, 8e6, 18*time.Millisecond) // one wave: 10 ms + 8 MB at 1 ms
		} else {
			f.ObserveLoad(plan.G4, 32e6, 52*time.Millisecond) // two waves of 10 ms + 16 MB
		}
	}
	c := f.Tier(plan.G4)
	require.InDelta(t, 0.010, c.Latency.Seconds(), 2e-3)
	require.InDelta(t, 0.001, c.SecondsPerMB, 1e-4)
}
