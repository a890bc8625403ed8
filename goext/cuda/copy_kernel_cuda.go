//go:build cuda

package cuda

import ()

// Kernel mode (DYN_KVBM_CUDA_COPY=kernel): one zero-copy gather/scatter
// kernel over the mapped host memory.

func (c *Copier) runKernel(l *lane, toG1 bool, blocks []int, host []uintptr) error {
	addrs := make([]uintptr, len(host))
	for i, p := range host {
		d, err := c.devAddr(p, c.bpb)
		if err != nil {
			return err
		}
		addrs[i] = d
	}
	ids, dAddrs, err := c.upload(l, l.stream, blocks, addrs)
	if err != nil {
		return err
	}
	return c.launch(l.stream, c.grid, 256, toG1, ids, dAddrs, len(blocks), addrs)
}
