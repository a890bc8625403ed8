//go:build cuda

package cuda

import (
	"fmt"

	"gorgonia.org/cu"
)

// Direct mode (DYN_KVBM_CUDA_COPY=direct): one DMA copy per run of blocks
// contiguous in G1 and in host memory (TensorRT-LLM's layout).

func (c *Copier) runDirect(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	return c.blockCopies(l.dma, toG1, blocks, host)
}

// blockCopies enqueues one plain DMA copy per block, whose G1 range is
// contiguous: blocks adjacent in G1 and in host memory go as one copy;
// copies alternate between the streams.
func (c *Copier) blockCopies(streams []cu.Stream, toG1 bool, blocks []int, host []uintptr) error {
	for i, k := 0, 0; i < len(blocks); {
		j := i + 1
		for j < len(blocks) && blocks[j] == blocks[j-1]+1 && c.blockStride == c.bpb && host[j] == host[j-1]+uintptr(c.bpb) {
			j++
		}
		if err := c.dma(streams[k%len(streams)], toG1, cu.DevicePtr(c.eng.ChunkAddr(blocks[i], 0, 0)), host[i], int64(j-i)*c.bpb); err != nil {
			return fmt.Errorf("cuda: copy G1 block %d: %w", blocks[i], err)
		}
		i, k = j, k+1
	}
	return nil
}
