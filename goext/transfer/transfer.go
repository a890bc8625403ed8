// Package transfer moves block bytes between an engine layout (G1) and the
// contiguous host layout, and runs batches of such copies with bounded
// parallelism. It knows nothing about requests or tiers' bookkeeping.
package transfer

import (
	"sync"
	"unsafe"

	"github.com/kvbm/kvbm/goext/layout"
)

// bytesAt views n bytes at addr, memory owned by someone else (the engine).
// The pointer is read through memory rather than converted from a uintptr
// expression, so vet's unsafeptr check and the race detector's checkptr do
// not mistake engine memory for a Go object derived by pointer arithmetic.
func bytesAt(addr uintptr, n int64) []byte {
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// Gather copies G1 block `block` (every layer and K/V chunk) into dst, laid
// out as e.Host(). dst must hold at least e.BytesPerBlock() bytes and block
// must be < e.NumBlocks.
func Gather(e *layout.Engine, block int, dst []byte) {
	h := e.Host()
	_ = dst[h.BytesPerBlock()-1] // one bounds check for the whole block
	for l := 0; l < e.NumLayers; l++ {
		for o := 0; o < e.OuterDim; o++ {
			off := h.ChunkOffset(l, o)
			copyChunk(dst[off:off+e.ChunkBytes], bytesAt(e.ChunkAddr(block, l, o), e.ChunkBytes))
		}
	}
}

// Scatter copies src (one block in e.Host() layout) into G1 block `block`.
func Scatter(e *layout.Engine, block int, src []byte) {
	h := e.Host()
	_ = src[h.BytesPerBlock()-1]
	for l := 0; l < e.NumLayers; l++ {
		for o := 0; o < e.OuterDim; o++ {
			off := h.ChunkOffset(l, o)
			copyChunk(bytesAt(e.ChunkAddr(block, l, o), e.ChunkBytes), src[off:off+e.ChunkBytes])
		}
	}
}

// GatherBlocks is Gather for several blocks: dsts[i] receives G1 block
// blocks[i]. It walks (layer, outer, block) rather than block by block, so
// with block ids sorted, consecutive copies read neighbouring engine memory
// (one long stream per layer and K/V instead of 2 × layers short ones per
// block); scattered reads were measured at ~60% of a contiguous memcpy, this
// order recovers most of the gap.
func GatherBlocks(e *layout.Engine, blocks []int, dsts [][]byte) {
	h := e.Host()
	for i := range blocks {
		_ = dsts[i][h.BytesPerBlock()-1]
	}
	for l := 0; l < e.NumLayers; l++ {
		for o := 0; o < e.OuterDim; o++ {
			off := h.ChunkOffset(l, o)
			for i, b := range blocks {
				copyChunk(dsts[i][off:off+e.ChunkBytes], bytesAt(e.ChunkAddr(b, l, o), e.ChunkBytes))
			}
		}
	}
}

// ScatterBlocks is Scatter for several blocks: srcs[i] goes to G1 block blocks[i].
func ScatterBlocks(e *layout.Engine, blocks []int, srcs [][]byte) {
	h := e.Host()
	for i := range blocks {
		_ = srcs[i][h.BytesPerBlock()-1]
	}
	for l := 0; l < e.NumLayers; l++ {
		for o := 0; o < e.OuterDim; o++ {
			off := h.ChunkOffset(l, o)
			for i, b := range blocks {
				copyChunk(bytesAt(e.ChunkAddr(b, l, o), e.ChunkBytes), srcs[i][off:off+e.ChunkBytes])
			}
		}
	}
}

// Limiter bounds how many transfer batches run at once across every caller
// sharing it (DYN_KVBM_MAX_CONCURRENT_TRANSFERS). Each running batch holds
// one slot; slot numbers index per-slot scratch buffers (disk bounce buffers).
type Limiter struct {
	slots chan int
}

// NewLimiter returns a Limiter with n slots (n < 1 is treated as 1).
func NewLimiter(n int) *Limiter {
	if n < 1 {
		n = 1
	}
	l := &Limiter{slots: make(chan int, n)}
	for i := 0; i < n; i++ {
		l.slots <- i
	}
	return l
}

// Slots is the number of slots.
func (l *Limiter) Slots() int { return cap(l.slots) }

// Run splits items [0, n) into batches of at most batch items and calls
// fn(slot, lo, hi) for each batch on its own goroutine while holding a slot.
// It returns when every batch has returned. fn must not call Run on the same
// Limiter (it could wait for a slot it holds).
func (l *Limiter) Run(n, batch int, fn func(slot, lo, hi int)) {
	if batch < 1 {
		batch = 1
	}
	var wg sync.WaitGroup
	for lo := 0; lo < n; lo += batch {
		hi := min(lo+batch, n)
		slot := <-l.slots
		wg.Go(func() {
			defer func() { l.slots <- slot }()
			fn(slot, lo, hi)
		})
	}
	wg.Wait()
}
