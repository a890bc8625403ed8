package policy

import (
	"fmt"
	"math/bits"
)

// Sketch is a count-min sketch of 4-bit counters over sequence hashes, in
// the manner of TinyLFU: four rows, each hash increments one counter per
// row (conservative update: only the rows at the minimum), its estimate is
// the minimum, and after every SampleSize increments every counter is
// halved, so what was popular long ago fades. Its memory is fixed at
// creation (Bytes), whatever the number of distinct hashes.
//
// A block that many requests share as a prefix has one sequence hash, so
// every request that extends it counts it again: "seen often" and "a
// prefix of many" are the same count.
//
// Not safe for concurrent use (the leader calls it under its lock).
type Sketch struct {
	rows       [sketchRows][]uint64 // 16 counters per word
	mask       uint64               // counters per row − 1
	additions  int
	sampleSize int
}

const (
	sketchRows = 4
	counterMax = 15
	// MinSketchCounters and MaxSketchCounters bound NewSketch's argument.
	MinSketchCounters = 1 << 10
	MaxSketchCounters = 1 << 28
	// DefaultSketchCounters per row: 4 rows × 4 Mi counters × 4 bits =
	// 8 MiB. With the sample size at half the row, a stream of distinct
	// hashes leaves about 2% of new hashes looking "seen twice" at the end
	// of a window (less on average), and the window is 2 Mi block
	// sightings: at 16 tokens a block, 32 M prompt tokens.
	DefaultSketchCounters = 1 << 22
)

var rowSeeds = [sketchRows]uint64{0x9e3779b97f4a7c15, 0xbf58476d1ce4e5b9, 0x94d049bb133111eb, 0xd6e8feb86659fd93}

// NewSketch creates a sketch with counters per row (a power of two in
// [MinSketchCounters, MaxSketchCounters]).
func NewSketch(counters int) (*Sketch, error) {
	if counters < MinSketchCounters || counters > MaxSketchCounters || bits.OnesCount(uint(counters)) != 1 {
		return nil, fmt.Errorf("policy: sketch of %d counters per row: want a power of two in [%d, %d]",
			counters, MinSketchCounters, MaxSketchCounters)
	}
	s := &Sketch{mask: uint64(counters - 1), sampleSize: counters / 2}
	for r := range s.rows {
		s.rows[r] = make([]uint64, counters/16)
	}
	return s, nil
}

// Bytes is the sketch's memory for counters (fixed).
func (s *Sketch) Bytes() int { return sketchRows * len(s.rows[0]) * 8 }

// SampleSize is how many increments pass between halvings.
func (s *Sketch) SampleSize() int { return s.sampleSize }

func (s *Sketch) slot(r int, h uint64) (word int, shift uint) {
	x := (h ^ rowSeeds[r]) * 0xff51afd7ed558ccd
	x ^= x >> 33
	i := x & s.mask
	return int(i >> 4), uint(i&15) * 4
}

// Estimate returns how often h was seen (0..15), within the sketch's error.
func (s *Sketch) Estimate(h uint64) int {
	m := counterMax
	for r := range s.rows {
		w, sh := s.slot(r, h)
		m = min(m, int(s.rows[r][w]>>sh&15))
	}
	return m
}

// Add counts one sighting of h and returns its new estimate.
func (s *Sketch) Add(h uint64) int {
	est := s.Estimate(h)
	if est < counterMax {
		for r := range s.rows {
			w, sh := s.slot(r, h)
			if int(s.rows[r][w]>>sh&15) == est {
				s.rows[r][w] += 1 << sh
			}
		}
		est++
	}
	s.additions++
	if s.additions >= s.sampleSize {
		s.halve()
	}
	return est
}

// halve ages every counter: each becomes half of itself.
func (s *Sketch) halve() {
	for r := range s.rows {
		row := s.rows[r]
		for i := range row {
			row[i] = row[i] >> 1 & 0x7777777777777777
		}
	}
	s.additions /= 2
}

// Reset forgets everything.
func (s *Sketch) Reset() {
	for r := range s.rows {
		clear(s.rows[r])
	}
	s.additions = 0
}
