package policy

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// splitmix64: distinct, well-spread test hashes.
func mix(i uint64) uint64 {
	z := i + 0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

func TestSketchCountsAndHalves(t *testing.T) {
	s, err := NewSketch(MinSketchCounters)
	require.NoError(t, err)
	require.Equal(t, 4*MinSketchCounters/2, s.Bytes())
	h := mix(1)
	require.Equal(t, 0, s.Estimate(h))
	require.Equal(t, 1, s.Add(h))
	require.Equal(t, 2, s.Add(h))
	for range 20 {
		s.Add(h)
	}
	require.Equal(t, counterMax, s.Estimate(h), "saturates")
	// After a sample's worth of other additions, h's count has halved.
	for i := range s.SampleSize() {
		s.Add(mix(uint64(1000 + i)))
	}
	require.Equal(t, counterMax/2, s.Estimate(h))
	s.Reset()
	require.Equal(t, 0, s.Estimate(h))
}

func TestSketchSizes(t *testing.T) {
	for _, n := range []int{0, MinSketchCounters - 1, MinSketchCounters + 16, MaxSketchCounters * 2} {
		_, err := NewSketch(n)
		require.ErrorContains(t, err, "policy: sketch of", n)
	}
}

// 10M distinct hashes (1M under -race): the sketch's memory does not grow
// past its fixed bound, and a first sighting rarely looks like a second
// one (what a unique-prompt workload would write to a slower tier).
func TestSketchMemoryBoundUnderDistinctHashes(t *testing.T) {
	n := 10_000_000
	if raceEnabled {
		n = 1_000_000
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	s, err := NewSketch(DefaultSketchCounters)
	require.NoError(t, err)
	bound := 4 * DefaultSketchCounters / 2 // 4 rows of 4-bit counters
	require.Equal(t, bound, s.Bytes())
	admitted := 0
	for i := range n {
		if s.Add(mix(uint64(i))) >= MinCount {
			admitted++
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	require.Equal(t, bound, s.Bytes())
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	require.LessOrEqual(t, grown, int64(bound)+1<<20, "heap grew %d bytes for a %d-byte sketch", grown, bound)
	runtime.KeepAlive(s)
	rate := float64(admitted) / float64(n)
	t.Logf("%d distinct hashes: %.3f%% looked seen twice; sketch %d bytes", n, 100*rate, s.Bytes())
	require.Less(t, rate, 0.03)
}

func TestGateSketchAndBudget(t *testing.T) {
	now := time.Unix(0, 0)
	clock := func() time.Time { return now }

	open, err := NewGate(AdmitAll, 0, clock)
	require.NoError(t, err)
	ok, _ := open.Admit(0)
	require.True(t, ok)

	sk, err := NewGate(AdmitSketch, 0, clock)
	require.NoError(t, err)
	ok, why := sk.Admit(1)
	require.False(t, ok)
	require.Equal(t, RejectCold, why)
	ok, _ = sk.Admit(MinCount)
	require.True(t, ok)

	// 10 writes a second, a burst of 10: lukewarm blocks get the first
	// half of the bucket, hot ones the rest.
	b, err := NewGate(AdmitAll, 10, clock)
	require.NoError(t, err)
	warm := 0
	for range 20 {
		if ok, _ := b.Admit(MinCount); ok {
			warm++
		}
	}
	require.Equal(t, 5, warm)
	hot := 0
	for range 20 {
		if ok, _ := b.Admit(HotCount); ok {
			hot++
		}
	}
	require.Equal(t, 5, hot)
	ok, why = b.Admit(15)
	require.False(t, ok)
	require.Equal(t, RejectBudget, why)
	now = now.Add(time.Second) // refilled
	ok, _ = b.Admit(MinCount)
	require.True(t, ok)

	for _, bad := range []float64{-1, 1 / zero(), -1 / zero()} {
		_, err := NewGate(AdmitAll, bad, clock)
		require.ErrorContains(t, err, "policy: write budget")
	}
	m, err := ParseAdmit("sketch")
	require.NoError(t, err)
	require.Equal(t, AdmitSketch, m)
	_, err = ParseAdmit("lfu")
	require.ErrorContains(t, err, `policy: unknown admission "lfu"`)
}

func zero() float64 { return 0 }
