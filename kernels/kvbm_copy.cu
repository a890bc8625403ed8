// kvbm_copy.cu: batched block copies between an engine's paged KV tensors
// (G1) and kvbm's block-contiguous host layout (one block = layers × outer ×
// chunk bytes, see goext/layout).
//
// One launch moves a whole batch: chunk c = (i, layer, outer) of batch entry
// i lives at
//     g1   = layer_bases[layer] + g1_blocks[i] * block_stride + outer * outer_stride
//     host = host_addrs[i] + (layer * outer_dim + outer) * chunk_bytes
// layer_bases[l] is the address of chunk (block 0, layer l, outer 0); this
// covers one tensor per layer (vLLM FlashAttention [2,N,bs,H,D], FlashInfer
// [N,2,bs,H,D], MLA) and TensorRT-LLM's single [N,L,2,...] pool alike.
// host_addrs are device-visible addresses: mapped page-locked host memory
// (the GPU reads or writes host memory directly, zero-copy) or a device
// staging buffer that one large DMA copy then moves.
//
// Every parameter is 8 bytes wide: gorgonia.org/cu's Function.Launch copies
// each kernel argument as a uint64.
//
// Build (on a machine with nvcc; kernels/build.sh):
//   nvcc -fatbin -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 ...
//   nvcc -ptx -arch=compute_80 ...
#include <stdint.h>

// Vectors of 16 bytes each thread keeps in flight: loads are issued before
// stores so that a warp reading host memory over PCIe has 8 requests
// outstanding per thread instead of 1.
#define KVBM_UNROLL 8

struct __align__(16) v16 {
    unsigned long long a, b;
};

__device__ __forceinline__ void chunk_addrs(
    const unsigned long long* __restrict__ layer_bases, long long block_stride, long long outer_stride,
    const long long* __restrict__ g1_blocks, const unsigned long long* __restrict__ host_addrs,
    long long n_layers, long long outer_dim, long long chunk_bytes, long long c,
    char** g1, char** host) {
    long long per_block = n_layers * outer_dim;
    long long i = c / per_block;
    long long r = c - i * per_block;
    long long layer = r / outer_dim;
    long long outer = r - layer * outer_dim;
    *g1 = (char*)(layer_bases[layer] + (unsigned long long)(g1_blocks[i] * block_stride + outer * outer_stride));
    *host = (char*)(host_addrs[i] + (unsigned long long)(r * chunk_bytes));
}

// kvbm_copy_chunks_v16: every address and chunk_bytes are multiples of 16.
// to_g1 = 0: G1 → host (offload), otherwise host → G1 (onboard).
extern "C" __global__ void __launch_bounds__(256) kvbm_copy_chunks_v16(
    const unsigned long long* __restrict__ layer_bases, long long block_stride, long long outer_stride,
    const long long* __restrict__ g1_blocks, const unsigned long long* __restrict__ host_addrs,
    long long n, long long n_layers, long long outer_dim, long long chunk_bytes, long long to_g1) {
    const long long chunks = n * n_layers * outer_dim;
    const long long vecs = chunk_bytes / 16;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        char *g1, *host;
        chunk_addrs(layer_bases, block_stride, outer_stride, g1_blocks, host_addrs, n_layers, outer_dim,
                    chunk_bytes, c, &g1, &host);
        const v16* src = (const v16*)(to_g1 ? host : g1);
        v16* dst = (v16*)(to_g1 ? g1 : host);
        long long v = threadIdx.x;
        for (; v + (KVBM_UNROLL - 1) * (long long)blockDim.x < vecs; v += KVBM_UNROLL * (long long)blockDim.x) {
            v16 t[KVBM_UNROLL];
#pragma unroll
            for (int k = 0; k < KVBM_UNROLL; k++) t[k] = src[v + k * blockDim.x];
#pragma unroll
            for (int k = 0; k < KVBM_UNROLL; k++) dst[v + k * blockDim.x] = t[k];
        }
        for (; v < vecs; v += blockDim.x) dst[v] = src[v];
    }
}

// kvbm_copy_chunks_b1: any alignment (byte copies); the Go side uses it only
// when some address or the chunk size is not a multiple of 16.
extern "C" __global__ void __launch_bounds__(256) kvbm_copy_chunks_b1(
    const unsigned long long* __restrict__ layer_bases, long long block_stride, long long outer_stride,
    const long long* __restrict__ g1_blocks, const unsigned long long* __restrict__ host_addrs,
    long long n, long long n_layers, long long outer_dim, long long chunk_bytes, long long to_g1) {
    const long long chunks = n * n_layers * outer_dim;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        char *g1, *host;
        chunk_addrs(layer_bases, block_stride, outer_stride, g1_blocks, host_addrs, n_layers, outer_dim,
                    chunk_bytes, c, &g1, &host);
        const char* src = to_g1 ? host : g1;
        char* dst = to_g1 ? g1 : host;
        for (long long b = threadIdx.x; b < chunk_bytes; b += blockDim.x) dst[b] = src[b];
    }
}
