// Package checked holds overflow-checked size arithmetic shared by the
// packages that size allocations from outside input (configuration,
// engine layouts): an overflow is an error their callers name, never a
// wrapped product.
package checked

import (
	"math"
	"math/bits"
)

// Mul multiplies non-negative sizes; ok is false when a factor is negative
// or the product overflows int64.
func Mul(factors ...int64) (product int64, ok bool) {
	var p uint64 = 1
	for _, f := range factors {
		if f < 0 {
			return 0, false
		}
		hi, lo := bits.Mul64(p, uint64(f))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, false
		}
		p = lo
	}
	return int64(p), true
}
