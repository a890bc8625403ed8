// Package cuda is kvbm's GPU data path, compiled only with the `cuda` build
// tag (every other file of the package carries it): a default build has no
// CUDA dependency and this package is empty there.
//
// A Copier moves whole blocks between an engine's GPU-resident KV tensors
// (G1, any goext/layout layout) and kvbm's block-contiguous host memory (G2
// and the disk tier's bounce buffers), which it page-locks. It works in the
// engine's primary CUDA context (the one PyTorch uses), on two streams of its
// own (one per direction, so offloads and onboards share PCIe both ways), and
// orders itself after the engine's stream with an event (Fence).
//
// Copies never go one cudaMemcpy per layer per block. Per-layer layouts are
// gathered/scattered by a kernel (kernels/kvbm_copy.cu), which either goes
// through a device staging buffer whose slots cross PCIe as DMA copies on the
// copy engines ("staged": pipelined, fixed grid, one DMA copy per run of
// blocks adjacent in host memory) or reads/writes the mapped host
// memory directly ("kernel", zero-copy: as fast on an idle GPU, but it holds
// every SM while it waits on PCIe, and an engine's matmul ran 92% slower
// meanwhile). Layouts whose blocks are contiguous in G1 (TensorRT-LLM) can
// also move as one DMA copy per block ("direct"), and layouts of long
// contiguous pieces with no kernel at all through the driver's batched copy
// ("batch", cuMemcpyBatchAsync looked up at run time). The default ("auto")
// is "batch" for pieces of 64 KiB or more where the driver has it, else
// "staged". docs/cuda.md has the numbers.
package cuda
