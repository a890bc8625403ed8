//go:build cuda

package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	"gorgonia.org/cu"
)

// Staged mode (DYN_KVBM_CUDA_COPY=staged): a gather/scatter kernel into
// device staging slots, each crossing PCIe as one DMA copy while the next
// slot fills.

// runStaged pipelines the batch through the lane's staging slots. Offload,
// chunk j in slot s = j mod depth:
//
//	kstream:        wait dDone[s] (the DMA of chunk j-depth left slot s) → gather chunk j into slot s → record kDone[s]
//	dma[j mod n]:   wait kDone[s] → DMA slot s → host → record dDone[s]
//
// Onboard mirrors it (DMA host → slot first, then the scatter kernel). The
// kernels use a small fixed grid; PCIe is crossed by the copy engines only,
// with one DMA copy per run of blocks adjacent in host memory.
func (c *Copier) runStaged(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	st, err := c.prepareStaged(l, blocks, host)
	if err != nil {
		return err
	}
	for j, lo := 0, 0; lo < len(st.blocks); j, lo = j+1, lo+c.stagingSlots {
		if err := c.stageChunk(l, toG1, st, j, lo, min(lo+c.stagingSlots, len(st.blocks))); err != nil {
			return err
		}
	}
	return nil
}

// staged is a batch prepared for the staging buffer: its entries in host
// order, each entry's staging address, and the descriptors uploaded for the
// kernels. The buffer is a ring of depth × slot-size blocks: entry i lies at
// ring position i mod (depth × slot size), so a chunk of consecutive
// entries (at most a slot's worth) never overlaps the depth-1 chunks
// before it, whatever their sizes.
type staged struct {
	blocks      []int
	host, addrs []uintptr
	ids, dAddrs cu.DevicePtr
}

// prepareStaged orders the batch by host address (blocks adjacent in host
// memory then share one DMA copy; the worker orders a batch by G1 block,
// which leaves the host side scattered; each entry is independent, so the
// order is free), makes room for the staging buffer and uploads every
// entry's descriptors with one copy on the kernel stream, before any of the
// batch's DMA copies can queue ahead of it.
func (c *Copier) prepareStaged(l *lane, blocks []int, host []uintptr) (*staged, error) {
	if !slices.IsSorted(host) {
		idx := make([]int, len(host))
		for i := range idx {
			idx[i] = i
		}
		slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(host[a], host[b]) })
		b2, h2 := make([]int, len(idx)), make([]uintptr, len(idx))
		for i, j := range idx {
			b2[i], h2[i] = blocks[j], host[j]
		}
		blocks, host = b2, h2
	}
	ring := c.depth * c.stagingSlots
	if l.staging == 0 {
		p, err := cu.MemAlloc(int64(ring) * c.bpb)
		if err != nil {
			return nil, fmt.Errorf("cuda: allocate %d×%d-block staging buffer: %w", c.depth, c.stagingSlots, err)
		}
		l.staging = p
	}
	st := &staged{blocks: blocks, host: host, addrs: make([]uintptr, len(blocks))}
	for i := range st.addrs {
		st.addrs[i] = uintptr(l.staging) + uintptr(int64(i%ring)*c.bpb)
	}
	var err error
	if st.ids, st.dAddrs, err = c.upload(l, l.kstream, blocks, st.addrs); err != nil {
		return nil, err
	}
	return st, nil
}

// stageChunk enqueues chunk j, entries [lo, hi) of st (at most one slot's
// worth), marking its ends with slot j mod depth's events. The stream
// waits order it after chunk j-depth, the last that may have used its
// part of the ring.
func (c *Copier) stageChunk(l *lane, toG1 bool, st *staged, j, lo, hi int) error {
	blocks, host, addrs := st.blocks, st.host, st.addrs
	s := j % c.depth
	ds := l.dma[j%len(l.dma)] // this chunk's DMA stream
	off := cu.DevicePtr(8 * lo)
	kernel := func() error {
		return c.launch(l.kstream, c.stagedGrid, c.opts.StagedThreads, toG1, st.ids+off, st.dAddrs+off, hi-lo, addrs[lo:hi])
	}
	if !toG1 {
		if j >= c.depth {
			if err := l.kstream.Wait(l.dDone[s], 0); err != nil {
				return fmt.Errorf("cuda: wait for staging slot: %w", err)
			}
		}
		if err := kernel(); err != nil {
			return err
		}
		if err := errors.Join(l.kDone[s].Record(l.kstream), ds.Wait(l.kDone[s], 0)); err != nil {
			return fmt.Errorf("cuda: order staging copies: %w", err)
		}
	} else if j >= c.depth {
		if err := ds.Wait(l.kDone[s], 0); err != nil {
			return fmt.Errorf("cuda: wait for staging slot: %w", err)
		}
	}
	// One DMA copy per run of entries adjacent both in host memory and in
	// the ring.
	for i := lo; i < hi; {
		k := i + 1
		for k < hi && host[k] == host[k-1]+uintptr(c.bpb) && addrs[k] == addrs[k-1]+uintptr(c.bpb) {
			k++
		}
		if err := c.dma(ds, toG1, cu.DevicePtr(addrs[i]), host[i], int64(k-i)*c.bpb); err != nil {
			return fmt.Errorf("cuda: staging copy of G1 block %d: %w", blocks[i], err)
		}
		i = k
	}
	if err := l.dDone[s].Record(ds); err != nil {
		return fmt.Errorf("cuda: record staging copy: %w", err)
	}
	if toG1 {
		if err := l.kstream.Wait(l.dDone[s], 0); err != nil {
			return fmt.Errorf("cuda: order staging copies: %w", err)
		}
		if err := kernel(); err != nil {
			return err
		}
		if err := l.kDone[s].Record(l.kstream); err != nil {
			return fmt.Errorf("cuda: record staging kernel: %w", err)
		}
	}
	return nil
}
