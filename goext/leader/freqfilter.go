package leader

import "time"

// Frequency filter parameters (design §4, as the reference).
const (
	freqMinOffload  = 2                 // a block goes to disk once its counter reaches this
	freqDecayPeriod = 600 * time.Second // every period all counters drop by one
	freqMaxEntries  = 1_000_000         // above this, decay until back under
)

// freqFilter spares the disk from one-off blocks: G2→G3 copies happen only
// for sequence hashes seen at least twice within the decay window. A counter
// starts at 1 on the first registration and doubles on each later one (or on
// a G2 hit that is onboarded), so a block needs two sightings, and a popular
// one keeps a high count that survives many decay periods.
//
// Decay is applied lazily when the filter is consulted: the effect is the same
// as the reference's periodic timer and no goroutine is needed.
type freqFilter struct {
	counts     map[uint64]uint32
	period     time.Duration
	maxEntries int
	last       time.Time // time of the last decay step
	now        func() time.Time
}

func newFreqFilter(now func() time.Time) *freqFilter {
	return &freqFilter{
		counts:     make(map[uint64]uint32),
		period:     freqDecayPeriod,
		maxEntries: freqMaxEntries,
		last:       now(),
		now:        now,
	}
}

// observe records one registration (or hit) of h and reports whether the
// block should now go to disk.
func (f *freqFilter) observe(h uint64) bool {
	if elapsed := f.now().Sub(f.last); elapsed >= f.period {
		steps := int64(elapsed / f.period)
		f.decay(uint32(min(steps, 1<<31)))
		f.last = f.last.Add(time.Duration(steps) * f.period)
	}
	c, ok := f.counts[h]
	switch {
	case !ok:
		c = 1
	case c >= 1<<31:
		// saturate instead of wrapping
	default:
		c *= 2
	}
	f.counts[h] = c
	for len(f.counts) > f.maxEntries {
		f.decay(1)
	}
	return c >= freqMinOffload
}

// decay lowers every counter by by, dropping those that reach zero.
func (f *freqFilter) decay(by uint32) {
	for h, c := range f.counts {
		if c <= by {
			delete(f.counts, h)
		} else {
			f.counts[h] = c - by
		}
	}
}

func (f *freqFilter) reset() { clear(f.counts) }
