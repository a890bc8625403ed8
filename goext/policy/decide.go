package policy

import (
	"fmt"
	"time"

	"github.com/kvbm/kvbm/goext/plan"
)

// Mode is the load policy (DYN_KVBM_LOAD_POLICY).
type Mode int

const (
	// Always loads every matched block.
	Always Mode = iota
	// Cost loads the matched prefix expected to save the most time.
	Cost
	// Cap loads the longest matched prefix expected to load within
	// LoadPolicy.Cap.
	Cap
)

func (m Mode) String() string {
	switch m {
	case Always:
		return "always"
	case Cost:
		return "cost"
	case Cap:
		return "never-slower-than"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// LoadPolicy is a Mode with its bound.
type LoadPolicy struct {
	Mode Mode
	Cap  time.Duration // Cap only
}

// NewLoadPolicy builds a policy from DYN_KVBM_LOAD_POLICY's parsed form
// (config.LoadPolicy: "always", "cost", "never-slower-than" with capMs).
func NewLoadPolicy(mode string, capMs float64) (LoadPolicy, error) {
	switch mode {
	case "", "always":
		return LoadPolicy{Mode: Always}, nil
	case "cost":
		return LoadPolicy{Mode: Cost}, nil
	case "never-slower-than":
		if !(capMs > 0) {
			return LoadPolicy{}, fmt.Errorf("policy: never-slower-than needs a positive bound, got %g ms", capMs)
		}
		return LoadPolicy{Mode: Cap, Cap: seconds(capMs / 1e3)}, nil
	}
	return LoadPolicy{}, fmt.Errorf("policy: unknown load policy %q (always, cost, never-slower-than=<ms>)", mode)
}

// Why a matched block was not loaded.
const (
	// ReasonSlower: loading it was expected to take longer than computing
	// its tokens (Cost).
	ReasonSlower = "slower_than_recompute"
	// ReasonOverCap: loading it would take the load past the bound (Cap).
	ReasonOverCap = "over_bound"
)

// Decision is what to load of one request's match.
type Decision struct {
	// Load is how many leading blocks of the match to load.
	Load int
	// Skipped counts the matched blocks not loaded, by tier (index:
	// TierIndex), and Reason says why ("" when none is skipped).
	Skipped [3]int
	Reason  string
	// Expected seconds of loading the whole match, of loading the chosen
	// prefix, and of computing the whole match's tokens.
	LoadAll, LoadChosen, RecomputeAll float64
	// Explored: Cost loaded the whole match although the estimates
	// advised against it, to measure a tier that was never measured or
	// was skipped ExploreEvery times since its last measurement.
	Explored bool
}

// Tiers the decisions count, in TierIndex order.
var Tiers = [3]plan.Tier{plan.G2, plan.G3, plan.G4}

// TierIndex is t's index in Decision.Skipped (G2 0, G3 1, G4 2).
func TierIndex(t plan.Tier) (int, bool) { return tierIndex(t) }

// Shape is what a load looks like to the workers.
type Shape struct {
	BlockTokens int     // tokens per block
	MBPerBlock  float64 // one rank's share of a block, in MB
	// BatchBlocks and Concurrency: the workers copy G2 and G3 blocks in
	// batches of at most BatchBlocks, Concurrency batches at a time
	// (DYN_KVBM_MAX_TRANSFER_BATCH_SIZE, DYN_KVBM_MAX_CONCURRENT_TRANSFERS);
	// BatchBlocks 0: one batch whatever the size; Concurrency 0 counts as
	// 1. A tier's measurements are per batch; G4 downloads are measured per
	// load (the store bounds their concurrency itself).
	BatchBlocks, Concurrency int
	// Overhead: seconds any load of the match pays before its first block
	// moves (a G4 lookup still to be made: Model.LookupSeconds); 0 once the
	// lookup is done (its time is spent either way).
	Overhead float64
	// LookupConcurrency: HEAD requests a G4 lookup keeps in flight
	// (object.StoreOptions.Lookups; LookupWaves).
	LookupConcurrency int
}

// batched is the expected time of c blocks of a tier copied in batches:
// ceil(batches / Concurrency) waves of one full batch each.
func (s Shape) batched(c int, cost TierCost) float64 {
	if c <= 0 {
		return 0
	}
	b, k := s.BatchBlocks, max(s.Concurrency, 1)
	if b <= 0 {
		b = c
	}
	batches := (c + b - 1) / b
	waves := (batches + k - 1) / k
	return float64(waves) * cost.Seconds(float64(min(c, b))*s.MBPerBlock)
}

// Decide chooses the prefix of a match to load. tiers are the matched
// blocks' tiers in prefix order (G2, then G3, then G4). A G4 block is
// downloaded into G2 and copied from there, so it costs both. The tiers'
// times are added (the workers run G2 and G3 batches side by side, so this
// errs towards recomputing). G4 downloads pay the tier's latency once per
// wave (SetDownloadWave). A prefix whose deepest tier is G3 or G4 is never
// expected to load faster than loading requests of that tier were seen to
// wait end to end (ObserveEndToEnd: the steps the request waited while its
// load was in flight included).
//
// Cost picks the prefix length k maximising recompute(k) − load(k), the
// longest among equals, 0 when no prefix saves time: a G2 prefix that pays
// for itself is kept even when the G3 or G4 blocks after it do not.
// Because each tier's cost is a latency plus a per-block cost, a tier's
// blocks are worth loading only together, enough of them to repay its
// latency.
//
// Under Cost, a tier without any measurement is loaded rather than skipped
// (its cost is only a prior, and loading is how it gets measured; a tier
// that only ranks in other processes load is never measured here, so for
// it Cost behaves as Always), and so is a tier skipped ExploreFirst times
// since its last measurement, then twice as many after each exploration
// that did not make it worth loading, up to ExploreEvery.
func (m *Model) Decide(p LoadPolicy, tiers []plan.Tier, sh Shape) Decision {
	n := len(tiers)
	d := Decision{Load: n}
	if n == 0 {
		return d
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var cost [3]TierCost
	for i := range cost {
		cost[i] = m.tierLocked(i)
	}
	perToken := m.prefillLocked()

	var counts [3]int
	loadOf := func() float64 {
		g2 := counts[0] + counts[2] // G4 blocks go through G2
		t := sh.batched(g2, cost[0]) + sh.batched(counts[1], cost[1])
		if mb := float64(counts[2]) * sh.MBPerBlock; mb > 0 {
			// one request latency per wave of downloads
			t += float64(m.g4WavesLocked(2, mb))*cost[2].Latency.Seconds() + mb*cost[2].SecondsPerMB
		}
		// Never less than what loading requests of this deepest tier were
		// seen to wait end to end (ObserveEndToEnd).
		deep := 1
		if counts[2] > 0 {
			deep = 2
		}
		if counts[deep] > 0 {
			mb := float64(counts[0]+counts[1]+counts[2]) * sh.MBPerBlock
			if e, ok := m.e2eLocked(deep, mb); ok {
				t = max(t, e)
			}
		}
		return t
	}
	loads := make([]float64, n+1)
	for k, t := range tiers {
		if i, ok := tierIndex(t); ok {
			counts[i]++
		}
		loads[k+1] = loadOf() + sh.Overhead
	}
	d.LoadAll = loads[n]
	d.RecomputeAll = perToken * float64(n*sh.BlockTokens)
	switch p.Mode {
	case Always:
		d.LoadChosen = d.LoadAll
		return d
	case Cost:
		best, bestSave := 0, 0.0
		for k := 1; k <= n; k++ {
			if save := perToken*float64(k*sh.BlockTokens) - loads[k]; save >= bestSave && save > 0 {
				best, bestSave = k, save
			}
		}
		d.Load, d.Reason = best, ReasonSlower
	case Cap:
		k := 0
		for k < n && loads[k+1] <= p.Cap.Seconds() {
			k++
		}
		d.Load, d.Reason = k, ReasonOverCap
	}
	for _, t := range tiers[d.Load:] {
		if i, ok := tierIndex(t); ok {
			d.Skipped[i]++
		}
	}
	if p.Mode == Cost {
		for i, k := range d.Skipped {
			if k > 0 && (m.tiers[i].n == 0 || m.skips[i] >= min(ExploreFirst<<min(m.explored[i], 8), ExploreEvery)) {
				d.Explored = true
			}
		}
		var loaded [3]int
		for _, t := range tiers[:d.Load] {
			if i, ok := tierIndex(t); ok {
				loaded[i]++
			}
		}
		for i := range loaded {
			switch {
			case d.Explored && d.Skipped[i] > 0 && m.tiers[i].n > 0: // a re-exploration
				m.explored[i]++
			case !d.Explored && loaded[i] > 0:
				m.explored[i] = 0 // worth loading on its estimate again
			}
		}
		if d.Explored {
			d.Load, d.Skipped = n, [3]int{}
		}
		for i, k := range d.Skipped {
			if k > 0 {
				m.skips[i]++
			}
		}
	}
	d.LoadChosen = loads[d.Load]
	if d.Load == n {
		d.Reason = ""
	}
	return d
}
