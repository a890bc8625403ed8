//go:build cuda

package cuda

import (
	"fmt"

	"gorgonia.org/cu"
)

// Direct mode (DYN_KVBM_CUDA_COPY=direct): one DMA copy per run of blocks
// contiguous in G1 and in host memory (TensorRT-LLM's layout).

func (c *Copier) runDirect(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	// Blocks adjacent in G1 and in host memory go as one copy; copies
	// alternate between the DMA streams.
	for i, k := 0, 0; i < len(blocks); {
		j := i + 1
		for j < len(blocks) && blocks[j] == blocks[j-1]+1 && c.blockStride == c.bpb && host[j] == host[j-1]+uintptr(c.bpb) {
			j++
		}
		if err := c.dma(l.dma[k%len(l.dma)], toG1, cu.DevicePtr(c.eng.ChunkAddr(blocks[i], 0, 0)), host[i], int64(j-i)*c.bpb); err != nil {
			return fmt.Errorf("cuda: copy G1 block %d: %w", blocks[i], err)
		}
		i, k = j, k+1
	}
	return nil
}
