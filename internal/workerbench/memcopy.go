package workerbench

import (
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/kvbm/kvbm/goext/transfer"
)

// The G2 baselines copy the operation's bytes contiguously inside G1 memory
// (its first half onto its second half). kvbm's offload and onboard walk
// scattered 32 KiB chunks, so a contiguous copy by the same number of
// goroutines is the strongest honest comparison: same bytes, same
// parallelism, none of the scatter.

// ParallelCopy copies Bytes bytes with `threads` goroutines, each one
// contiguous share, with copy() or (nt) non-temporal stores. It returns the
// wall time from the first goroutine's start to the last one's end.
func (f *Fixture) ParallelCopy(threads int, nt bool) time.Duration {
	threads = max(threads, 1)
	n := min(f.Bytes, int64(len(f.g1))/2)
	src, dst := f.g1[:n], f.g1[n:2*n]
	share := (n/int64(threads) + 4095) &^ 4095
	cp := func(dst, src []byte) { copy(dst, src) }
	if nt {
		cp = transfer.CopyNonTemporal
	}
	var wg sync.WaitGroup
	start := time.Now()
	for lo := int64(0); lo < n; lo += share {
		hi := min(lo+share, n)
		wg.Go(func() { cp(dst[lo:hi], src[lo:hi]) })
	}
	wg.Wait()
	d := time.Since(start)
	// Scale in case G1 was too small to hold two copies of the working set.
	return time.Duration(float64(d) * float64(f.Bytes) / float64(n))
}

// Ceiling is the machine's measured copy bandwidth: the best STREAM-style
// copy (bytes copied per second; each byte read once and written once).
type Ceiling struct {
	GBps    float64
	Threads int
	NT      bool // the best run used non-temporal stores
}

// CeilingThreads are the thread counts CopyCeiling tries: powers of two up
// to GOMAXPROCS, GOMAXPROCS itself, and kvbm's concurrency (so the ceiling
// covers the equal-parallelism baselines).
func (f *Fixture) CeilingThreads() []int {
	p := runtime.GOMAXPROCS(0)
	var ts []int
	for t := 1; t < p; t *= 2 {
		ts = append(ts, t)
	}
	ts = append(ts, p, f.Opts.MaxConcurrent)
	slices.Sort(ts)
	return slices.Compact(ts)
}

// CopyCeiling measures the ceiling: every thread count of CeilingThreads,
// with copy() and (where transfer.HaveNonTemporal) non-temporal stores, best of `rounds` each.
func (f *Fixture) CopyCeiling(rounds int) Ceiling {
	var best Ceiling
	for _, t := range f.CeilingThreads() {
		for _, nt := range []bool{false, true} {
			if nt && !transfer.HaveNonTemporal {
				continue
			}
			for range max(rounds, 1) {
				if g := f.GBps(f.ParallelCopy(t, nt)); g > best.GBps {
					best = Ceiling{GBps: g, Threads: t, NT: nt}
				}
			}
		}
	}
	return best
}
