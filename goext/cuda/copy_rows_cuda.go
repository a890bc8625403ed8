//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/kvbm/kvbm/goext/layout"
)

// KV cache groups (layout/groups.go): a row names each group's G1 block at
// one token position, and layer l of the host block comes from (goes to)
// the block of l's group. Rows go by DMA copies of the pieces whatever the
// mode (adjacent pieces merged, shared between the lane's DMA streams): the
// gather/scatter kernels and the pitched copies address one block id for
// every layer. With the driver's batched copy (CUDA >= 12.8) a stream's
// share is one cuMemcpyBatchAsync call per batchMax pieces, else one
// cuMemcpyAsync per piece.

// GatherRows implements worker.G1RowCopier (G1 → host).
func (c *Copier) GatherRows(rows [][]int64, dsts [][]byte) error {
	return c.runRows(c.lanes[0], false, rows, dsts)
}

// ScatterRows implements worker.G1RowCopier (host → G1); the layers of a
// group whose entry is layout.NoBlock are not written.
func (c *Copier) ScatterRows(rows [][]int64, srcs [][]byte) error {
	return c.runRows(c.lanes[1], true, rows, srcs)
}

func (c *Copier) runRows(l *lane, toG1 bool, rows [][]int64, bufs [][]byte) error {
	if len(rows) != len(bufs) {
		return fmt.Errorf("cuda: %d group rows but %d buffers", len(rows), len(bufs))
	}
	e := c.eng
	groups := e.NumGroups()
	p := newPieces(len(rows) * e.NumLayers * e.OuterDim)
	for i, row := range rows {
		if len(row) != groups {
			return fmt.Errorf("cuda: group row %v has %d entries, the engine has %d KV cache groups", row, len(row), groups)
		}
		for g, b := range row {
			if b == layout.NoBlock && (toG1 || e.StateGroup(g)) {
				continue
			}
			if b < 0 || b >= int64(e.NumBlocks) {
				return fmt.Errorf("cuda: group %d's G1 block %d out of range [0, %d)", g, b, e.NumBlocks)
			}
		}
		if int64(len(bufs[i])) < c.bpb {
			return fmt.Errorf("cuda: buffer %d holds %d bytes, a block is %d", i, len(bufs[i]), c.bpb)
		}
		host := uint64(uintptr(unsafe.Pointer(&bufs[i][0])))
		if _, err := c.devAddr(uintptr(host), c.bpb); err != nil { // asynchronous DMA needs page-locked memory
			return err
		}
		for ly := 0; ly < e.NumLayers; ly++ {
			b := row[e.LayerGroup(ly)]
			if b == layout.NoBlock {
				if !toG1 { // a position without its state: zeroed, as transfer.GatherRows does
					for o := 0; o < e.OuterDim; o++ {
						off := e.Host().ChunkOffset(ly, o)
						clear(bufs[i][off : off+e.ChunkBytes])
					}
				}
				continue
			}
			for o := 0; o < e.OuterDim; o++ {
				p.add(toG1, uint64(e.ChunkAddr(int(b), ly, o)), host+uint64(e.Host().ChunkOffset(ly, o)), uint64(e.ChunkBytes))
			}
		}
	}
	if len(p.sizes) == 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return c.with(func() error {
		err := c.copyPieces(l.dma, toG1, p.dsts, p.srcs, p.sizes)
		// Wait even after an enqueue error, as run does.
		if serr := l.synchronize(); serr != nil {
			err = errors.Join(err, fmt.Errorf("cuda: synchronize: %w", serr))
		}
		return err
	})
}

// copyPieces enqueues copies dsts[k] ← srcs[k] of sizes[k] bytes, one
// contiguous share per stream, with the driver's batched copy where it has
// one.
func (c *Copier) copyPieces(streams []cu.Stream, toG1 bool, dsts, srcs, sizes []uint64) error {
	batched := batchInit() == nil
	ns := min(len(streams), len(sizes))
	for k := range ns {
		lo, hi := k*len(sizes)/ns, (k+1)*len(sizes)/ns
		if !batched {
			for j := lo; j < hi; j++ {
				dev, host := dsts[j], srcs[j]
				if !toG1 {
					dev, host = srcs[j], dsts[j]
				}
				if err := c.dma(streams[k], toG1, cu.DevicePtr(dev), uintptr(host), int64(sizes[j])); err != nil {
					return fmt.Errorf("cuda: copy a piece of %d bytes: %w", sizes[j], err)
				}
			}
			continue
		}
		for ; lo < hi; lo += batchMax {
			m := min(hi, lo+batchMax)
			if err := memcpyBatch(dsts[lo:m], srcs[lo:m], sizes[lo:m], toG1, c.ordinal, rawStream(&streams[k])); err != nil {
				return fmt.Errorf("cuda: batched copy: %w", err)
			}
		}
	}
	return nil
}
