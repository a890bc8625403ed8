package leader

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestFreqFilter(t *testing.T) {
	type op struct {
		advance time.Duration
		hash    uint64
		want    bool
	}
	tests := []struct {
		name string
		ops  []op
	}{
		{"first sighting stays off disk, second goes", []op{{0, 1, false}, {0, 1, true}, {0, 1, true}}},
		{"hashes are independent", []op{{0, 1, false}, {0, 2, false}, {0, 1, true}}},
		{"count 1 decays away after 600 s", []op{{0, 1, false}, {600 * time.Second, 1, false}}},
		{"not yet decayed at 599 s", []op{{0, 1, false}, {599 * time.Second, 1, true}}},
		// 1 → 2 → 4; one decay → 3; next sighting 6.
		{"popular blocks survive decay", []op{{0, 1, false}, {0, 1, true}, {0, 1, true}, {600 * time.Second, 1, true}}},
		// 1 → 2; two periods at once → 0 → gone; next sighting starts at 1.
		{"several periods decay at once", []op{{0, 1, false}, {0, 1, true}, {1200 * time.Second, 1, false}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := &fakeClock{t: time.Unix(0, 0)}
			f := newFreqFilter(c.Now)
			for i, o := range tc.ops {
				c.Advance(o.advance)
				require.Equal(t, o.want, f.observe(o.hash), "op %d", i)
			}
		})
	}
}

func TestFreqFilterCounts(t *testing.T) {
	c := &fakeClock{t: time.Unix(0, 0)}
	f := newFreqFilter(c.Now)
	for range 3 {
		f.observe(9)
	}
	require.Equal(t, uint32(4), f.counts[9], "1, then doubled twice")
	c.Advance(600 * time.Second)
	f.observe(8)
	require.Equal(t, uint32(3), f.counts[9], "decayed by one")
	for range 40 {
		f.observe(9)
	}
	sat := f.counts[9]
	require.GreaterOrEqual(t, sat, uint32(1<<31), "saturates instead of wrapping")
	f.observe(9)
	require.Equal(t, sat, f.counts[9])
}

func TestFreqFilterMaxEntries(t *testing.T) {
	c := &fakeClock{t: time.Unix(0, 0)}
	f := newFreqFilter(c.Now)
	f.maxEntries = 4
	f.observe(1)
	f.observe(1) // count 2
	for h := uint64(10); h < 13; h++ {
		f.observe(h)
	}
	require.Len(t, f.counts, 4)
	f.observe(99) // 5 entries → one decay: all count-1 entries go
	require.Equal(t, map[uint64]uint32{1: 1}, f.counts)
}

func TestMergeBlockIDs(t *testing.T) {
	tests := []struct {
		name          string
		have, in, out []int64
	}{
		{"append to empty", nil, []int64{1, 2}, []int64{1, 2}},
		{"plain append", []int64{1, 2}, []int64{3}, []int64{1, 2, 3}},
		{"full resend", []int64{1, 2}, []int64{1, 2, 3}, []int64{1, 2, 3}},
		{"identical resend", []int64{1, 2}, []int64{1, 2}, []int64{1, 2}},
		{"suffix/prefix overlap", []int64{1, 2, 3}, []int64{2, 3, 4}, []int64{1, 2, 3, 4}},
		{"nothing new", []int64{1, 2}, nil, []int64{1, 2}},
		{"no overlap", []int64{1, 2}, []int64{5, 6}, []int64{1, 2, 5, 6}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := &slot{}
			s.mergeBlockIDs(tc.have, nil)
			s.mergeBlockIDs(tc.in, nil)
			require.Equal(t, tc.out, s.g1)
			require.Len(t, s.prio, len(s.g1))
		})
	}
}

func TestMergeBlockIDsKeepsPrioritiesWithTheirBlocks(t *testing.T) {
	tests := []struct {
		name       string
		have       []int64
		havePrio   []int
		in         []int64
		inPrio     []int
		wantBlocks []int64
		wantPrio   []int
	}{
		{"aligned", nil, nil, []int64{1, 2, 3}, []int{80, 80, 10}, []int64{1, 2, 3}, []int{80, 80, 10}},
		{"full resend takes the new blocks' priorities", []int64{1, 2}, []int{80, 70},
			[]int64{1, 2, 3}, []int{0, 0, 60}, []int64{1, 2, 3}, []int{80, 70, 60}},
		{"overlap", []int64{1, 2}, []int{80, 70}, []int64{2, 3}, []int{0, 60}, []int64{1, 2, 3}, []int{80, 70, 60}},
		{"short list: the rest have none", nil, nil, []int64{1, 2}, []int{20},
			[]int64{1, 2}, []int{20, noPriority}},
		{"no priorities", []int64{1}, []int{50}, []int64{2}, nil, []int64{1, 2}, []int{50, noPriority}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := &slot{}
			s.mergeBlockIDs(tc.have, tc.havePrio)
			s.mergeBlockIDs(tc.in, tc.inPrio)
			require.Equal(t, tc.wantBlocks, s.g1)
			require.Equal(t, tc.wantPrio, s.prio)
		})
	}
}

func TestSetTokensKeepsHashesOfCommonPrefix(t *testing.T) {
	s := &slot{salt: 1}
	s.setTokens(toks(0, 10), bs)
	s.ensureHashes(2, bs)
	first := append([]uint64(nil), s.hashes...)
	s.setTokens(toks(0, 8), bs) // shorter prefix: ignored
	require.Len(t, s.tokens, 10)
	s.setTokens(toks(0, 13), bs) // longer: hashes kept
	require.Equal(t, first, s.hashes)
	s.ensureHashes(3, bs)
	require.Equal(t, seqHashesSalt(toks(0, 12), 1), s.hashes)
	s.setTokens(toks(1, 13), bs) // different: hashes reset
	require.Empty(t, s.hashes)
	s.setSalt(2)
	s.ensureHashes(1, bs)
	require.Equal(t, seqHashesSalt(toks(1, 4), 2), s.hashes)
}

func TestHitWindow(t *testing.T) {
	w := newHitWindow(2)
	require.Equal(t, "KVBM [worker-3] Cache Hit Rates - Host: 0.0% (0/0), Disk: 0.0% (0/0)", w.logLine(3))
	w.add(requestHits{queried: 10, host: 5, disk: 1})
	w.add(requestHits{queried: 10, host: 0, disk: 3})
	require.Equal(t, "KVBM [worker-3] Cache Hit Rates - Host: 25.0% (5/20), Disk: 20.0% (4/20)", w.logLine(3))
	w.add(requestHits{queried: 5, host: 5}) // the first request leaves the window
	h, d := w.rates()
	require.InDelta(t, 5.0/15, h, 1e-12)
	require.InDelta(t, 3.0/15, d, 1e-12)
}
