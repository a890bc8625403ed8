//go:build cuda

package cuda

import (
	"fmt"

	"gorgonia.org/cu"
)

// Batch mode (DYN_KVBM_CUDA_COPY=batch): the driver's batched copies
// (cuMemcpyBatchAsync) over the lane's DMA streams, and the plain DMA copy
// Direct uses too.

// batchMax is the most copies one cuMemcpyBatchAsync call carries.
const batchMax = 8192

// runBatch moves every chunk with the driver's batched copy, merging chunks
// adjacent in both G1 and host memory. The copies are split into one
// contiguous share per stream, at most batchMax copies per call.
func (c *Copier) runBatch(streams []cu.Stream, toG1 bool, blocks []int, host []uintptr) error {
	e := c.eng
	if c.pitched != nil {
		g1, hs := make([]uint64, len(blocks)), make([]uint64, len(blocks))
		for i, b := range blocks {
			g1[i], hs[i] = uint64(e.ChunkAddr(b, 0, 0)), uint64(host[i])
		}
		ns := min(len(streams), len(blocks))
		for k := range ns {
			lo, hi := k*len(blocks)/ns, (k+1)*len(blocks)/ns
			for ; lo < hi; lo += batchMax {
				m := min(hi, lo+batchMax)
				if err := memcpyBatch3D(g1[lo:m], hs[lo:m], *c.pitched, toG1, c.ordinal, rawStream(&streams[k])); err != nil {
					return fmt.Errorf("cuda: pitched batched copy: %w", err)
				}
			}
		}
		return nil
	}
	p := newPieces(len(blocks) * e.NumLayers * e.OuterDim)
	for i, b := range blocks {
		for ly := 0; ly < e.NumLayers; ly++ {
			for o := 0; o < e.OuterDim; o++ {
				p.add(toG1, uint64(e.ChunkAddr(b, ly, o)), uint64(host[i])+uint64(c.hostOff[ly*e.OuterDim+o]), uint64(e.ChunkBytes))
			}
		}
	}
	return c.copyPieces(streams, toG1, p.dsts, p.srcs, p.sizes)
}

// pieces lists copies, a piece continuing the last one on both sides merged
// into it.
type pieces struct{ dsts, srcs, sizes []uint64 }

func newPieces(n int) *pieces {
	return &pieces{make([]uint64, 0, n), make([]uint64, 0, n), make([]uint64, 0, n)}
}

// add lists the copy of n bytes between G1 address g and host address h,
// towards G1 when toG1.
func (p *pieces) add(toG1 bool, g, h, n uint64) {
	d, s := h, g
	if toG1 {
		d, s = g, h
	}
	if k := len(p.sizes); k > 0 && p.dsts[k-1]+p.sizes[k-1] == d && p.srcs[k-1]+p.sizes[k-1] == s {
		p.sizes[k-1] += n
		return
	}
	p.dsts, p.srcs, p.sizes = append(p.dsts, d), append(p.srcs, s), append(p.sizes, n)
}

// dma enqueues one copy of n bytes between device address d and page-locked
// host address h on s.
func (c *Copier) dma(s cu.Stream, toDev bool, d cu.DevicePtr, h uintptr, n int64) error {
	if toDev {
		return cu.MemcpyHtoDAsync(d, unsafePtr(h), n, s)
	}
	return cu.MemcpyDtoHAsync(unsafePtr(h), d, n, s)
}
