// Gather-kernel probe: how long kvbm's staged gather (kernels/kvbm_copy.cu)
// holds the SMs for one 64 MiB staging slot of scattered 32 KiB FlashAttention
// pieces, per grid size, against a contiguous device-to-device copy of the same
// bytes. The staged mode's cost to an engine is this time per slot.
//   nvcc -O3 -arch=sm_90 -o gather_kernel gather_kernel.cu && ./gather_kernel
#include "../../kernels/kvbm_copy.cu"
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); exit(1);} } while (0)

int main() {
  const int LAYERS = 32, NBLK = 8192, OUTER = 2;
  const long long CHUNK = 32768, BLOCK_BYTES = LAYERS * OUTER * CHUNK;  // 2 MiB
  const int SLOT_BLOCKS = 32;                                            // 64 MiB slot
  std::vector<unsigned long long> bases(LAYERS);
  for (int l = 0; l < LAYERS; l++) { char* p; CK(cudaMalloc(&p, (size_t)NBLK * OUTER * CHUNK)); bases[l] = (unsigned long long)p; }
  std::vector<int> ids(NBLK); for (int i = 0; i < NBLK; i++) ids[i] = i;
  std::mt19937 rng(1); std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<long long> g1(ids.begin(), ids.begin() + SLOT_BLOCKS);
  char* stage; CK(cudaMalloc(&stage, SLOT_BLOCKS * BLOCK_BYTES));
  char* stage2; CK(cudaMalloc(&stage2, SLOT_BLOCKS * BLOCK_BYTES));
  std::vector<unsigned long long> host(SLOT_BLOCKS);
  for (int i = 0; i < SLOT_BLOCKS; i++) host[i] = (unsigned long long)(stage + i * BLOCK_BYTES);
  unsigned long long *d_bases, *d_host; long long* d_g1;
  CK(cudaMalloc(&d_bases, LAYERS * 8)); CK(cudaMalloc(&d_host, SLOT_BLOCKS * 8)); CK(cudaMalloc(&d_g1, SLOT_BLOCKS * 8));
  CK(cudaMemcpy(d_bases, bases.data(), LAYERS * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_host, host.data(), SLOT_BLOCKS * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_g1, g1.data(), SLOT_BLOCKS * 8, cudaMemcpyHostToDevice));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  const size_t bytes = SLOT_BLOCKS * BLOCK_BYTES;
  const int REPS = 50;
  auto timeit = [&](auto f) { f(); CK(cudaDeviceSynchronize()); CK(cudaEventRecord(a)); for (int r = 0; r < REPS; r++) f();
    CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b)); return ms * 1000 / REPS; };
  float us = timeit([&] { CK(cudaMemcpyAsync(stage2, stage, bytes, cudaMemcpyDeviceToDevice)); });
  printf("contiguous D2D copy of %zu MiB: %.1f us (%.0f GB/s read+write each)\n", bytes >> 20, us, bytes / us / 1e3);
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int mult : {1, 2, 4, 8}) for (int threads : {256, 128}) {
    int grid = sms * mult;
    for (int dir = 0; dir < 2; dir++) {
      float t = timeit([&] { kvbm_copy_chunks_v16<<<grid, threads>>>(d_bases, CHUNK, (long long)NBLK * CHUNK, d_g1, d_host,
                                                                  SLOT_BLOCKS, LAYERS, OUTER, CHUNK, dir); CK(cudaGetLastError()); });
      printf("kvbm_copy_chunks_v16 grid=%d threads=%d %s: %.1f us (%.0f GB/s)\n", grid, threads, dir ? "scatter" : "gather ", t, bytes / t / 1e3);
    }
  }
  return 0;
}
