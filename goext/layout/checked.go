package layout

import (
	"math"
	"math/bits"
)

// mulChecked multiplies non-negative sizes; ok is false when the product
// overflows int64.
func mulChecked(factors ...int64) (product int64, ok bool) {
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
