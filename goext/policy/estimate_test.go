package policy

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvbm/kvbm/goext/plan"
)

func near(t *testing.T, want, got, rel float64, what string) {
	t.Helper()
	require.InDelta(t, want, got, math.Abs(want)*rel, what)
}

func TestModelStartsAtPriors(t *testing.T) {
	m := NewModel(0)
	for tier, prior := range map[plan.Tier]TierCost{plan.G2: priorG2, plan.G3: priorG3, plan.G4: priorG4} {
		c := m.Tier(tier)
		near(t, prior.Latency.Seconds(), c.Latency.Seconds(), 1e-4, tier.String()+" latency")
		near(t, prior.SecondsPerMB, c.SecondsPerMB, 1e-4, tier.String()+" s/MB")
	}
	near(t, priorPrefillPerToken.Seconds(), m.PrefillPerToken().Seconds(), 1e-4, "prefill")
	require.False(t, m.Snapshot().PrefillConfigured)
}

// Loads of varied sizes from a tier that costs 3 ms + 4 ms/MB: the fit finds
// both terms; the prior's weight leaves a few percent.
func TestModelFitsLatencyAndThroughput(t *testing.T) {
	m := NewModel(0)
	for i := range 200 {
		mb := float64(1 + i%8)
		m.ObserveLoad(plan.G3, int64(mb*1e6), time.Duration((3e-3+4e-3*mb)*1e9))
	}
	c := m.Tier(plan.G3)
	near(t, 3e-3, c.Latency.Seconds(), 0.1, "latency")
	near(t, 4e-3, c.SecondsPerMB, 0.05, "s/MB")
	require.Equal(t, uint64(200), m.Snapshot().Measured[plan.G3])
	// Other tiers are untouched.
	near(t, priorG2.SecondsPerMB, m.Tier(plan.G2).SecondsPerMB, 1e-6, "G2")
}

// A tier that slows down: the decayed fit follows within a hundred loads.
func TestModelFollowsASlowerTier(t *testing.T) {
	m := NewModel(0)
	obs := func(n int, lat, perMB float64) {
		for i := range n {
			mb := float64(1 + i%4)
			m.ObserveLoad(plan.G4, int64(mb*1e6), time.Duration((lat+perMB*mb)*1e9))
		}
	}
	obs(100, 5e-3, 1e-3)
	near(t, 5e-3+2e-3, m.Tier(plan.G4).Seconds(2), 0.05, "before")
	obs(80, 100e-3, 1e-3)
	near(t, 100e-3+2e-3, m.Tier(plan.G4).Seconds(2), 0.05, "after the slow-down")
}

// Every load the same size, and latency-only measurements (x = 0): the fit
// stays defined and predicts what was measured.
func TestModelDegenerateMeasurements(t *testing.T) {
	m := NewModel(0)
	for range 100 {
		m.ObserveLoad(plan.G2, 2e6, 2*time.Millisecond)
	}
	near(t, 2e-3, m.Tier(plan.G2).Seconds(2), 0.1, "same size")
	m2 := NewModel(0)
	for range 100 {
		m2.ObserveLoad(plan.G4, 0, 40*time.Millisecond)
	}
	near(t, 40e-3, m2.Tier(plan.G4).Latency.Seconds(), 0.1, "latency only")
	// Nonsense is ignored.
	m2.ObserveLoad(plan.G4, -1, time.Second)
	m2.ObserveLoad(plan.G1, 1e6, time.Second)
	require.Equal(t, uint64(100), m2.Snapshot().Measured[plan.G4])
}

// Steps of varied sizes at 2 ms + 100 µs a token; an idle gap is clipped.
func TestModelLearnsPrefillFromSteps(t *testing.T) {
	m := NewModel(0)
	now := time.Unix(1000, 0)
	step := func(tokens int, took time.Duration) {
		m.ObserveStep(now, tokens)
		now = now.Add(took)
	}
	cost := func(tokens int) time.Duration { return time.Duration((2e-3 + 100e-6*float64(tokens)) * 1e9) }
	for i := range 300 {
		n := 16 + (i%10)*200
		step(n, cost(n))
	}
	near(t, 100e-6, m.PrefillPerToken().Seconds(), 0.05, "per token")
	// An hour idle after a decode step (fewer than MinStepTokens tokens) is
	// not measured; after a prefill step it is one clipped sample.
	step(8, time.Hour)
	before := m.Snapshot().StepsMeasured
	step(500, cost(500))
	require.Equal(t, before, m.Snapshot().StepsMeasured)
	near(t, 100e-6, m.PrefillPerToken().Seconds(), 0.05, "after an idle decode step")
	step(600, time.Hour)
	step(500, cost(500))
	require.Less(t, m.PrefillPerToken().Seconds(), 2*100e-6)
}

func TestModelConfiguredPrefill(t *testing.T) {
	m := NewModel(250)
	now := time.Unix(0, 0)
	for i := range 50 {
		m.ObserveStep(now.Add(time.Duration(i)*time.Second), 100)
	}
	require.Equal(t, 250*time.Microsecond, m.PrefillPerToken())
	require.True(t, m.Snapshot().PrefillConfigured)
	require.Zero(t, m.Snapshot().StepsMeasured)
}

func TestTransfersReachSubscribedModels(t *testing.T) {
	m := NewModel(0)
	cancel := SubscribeTransfers(m.ObserveTransfer)
	ReportTransfer("g3_to_g1", 4e6, 10*time.Millisecond)
	ReportTransfer("g1_to_g2", 4e6, 10*time.Millisecond) // a save: not a load
	ReportTransfer("g4_to_g2", 0, time.Millisecond)      // nothing moved
	cancel()
	ReportTransfer("g3_to_g1", 4e6, 10*time.Millisecond)
	s := m.Snapshot()
	require.Equal(t, uint64(1), s.Measured[plan.G3])
	require.Zero(t, s.Measured[plan.G2])
	require.Zero(t, s.Measured[plan.G4])
}

// The leader's own timing of a load counts for G3/G4 until a worker of the
// process measures the tier directly; never for G2.
func TestModelLoadWaitYieldsToDirectMeasurements(t *testing.T) {
	m := NewModel(0)
	m.ObserveLoadWait(plan.G4, 1e6, 300*time.Millisecond)
	m.ObserveLoadWait(plan.G2, 1e6, 300*time.Millisecond)
	s := m.Snapshot()
	require.Equal(t, uint64(1), s.Measured[plan.G4])
	require.Zero(t, s.Measured[plan.G2])
	m.ObserveTransfer("g4_to_g2", 1e6, 10*time.Millisecond)
	m.ObserveLoadWait(plan.G4, 1e6, 300*time.Millisecond)
	require.Equal(t, uint64(2), m.Snapshot().Measured[plan.G4])
}
