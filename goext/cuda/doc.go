// Package cuda is kvbm's GPU data path, compiled only with the `cuda` build
// tag (every file of the package but knobs.go, the parsing of its tuning
// variables, carries it): a default build has no CUDA dependency.
//
// A Copier moves whole blocks between an engine's GPU-resident KV tensors
// (G1, any goext/layout layout) and kvbm's block-contiguous host memory (G2
// and the disk tier's bounce buffers), which it page-locks. It works in the
// engine's primary CUDA context (the one PyTorch uses), on streams of its
// own per direction (offloads and onboards share PCIe both ways), and orders
// itself after the engine's stream with an event (Fence).
//
// Copies never go one cudaMemcpy per layer per block. Per-layer layouts are
// gathered/scattered by a kernel (kernels/kvbm_copy.cu), which either goes
// through a device staging buffer whose slots cross PCIe as DMA copies on the
// copy engines ("staged": pipelined, fixed grid, one DMA copy per run of
// blocks adjacent in host memory) or reads/writes the mapped host memory
// directly ("kernel", zero-copy: as fast on an idle GPU, but it holds every
// SM while it waits on PCIe, and an engine's matmul ran 92% slower
// meanwhile). Layouts whose blocks are contiguous in G1 (TensorRT-LLM) can
// also move as one DMA copy per block ("direct"), and any layout with no
// kernel at all through the driver's batched copies ("batch",
// cuMemcpyBatchAsync / cuMemcpy3DBatchAsync looked up at run time). The
// default ("auto") is "split" where the driver has the batched copies:
// staged while the GPU is idle, batched while the engine's kernels hold the
// SMs, judged by how long its own kernels wait (runShared); "staged" on older
// drivers. docs/cuda.md has the numbers.
package cuda
