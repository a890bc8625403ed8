// Batched-DMA probe (cudaMemcpyBatchAsync, CUDA >= 12.8): how fast do the copy
// engines move scattered G1 pieces (FlashAttention: 32 KiB K or V of a layer;
// FlashInfer: 64 KiB K+V) to and from host memory, one way and both ways at
// once, against one contiguous copy of the same bytes, for cudaMallocHost memory
// and for an mmap region registered with cudaHostRegister (what kvbm's G2 is),
// and how fast the same batch gathers into device memory instead.
//   nvcc -O2 -arch=sm_90 -o ce_gather ce_gather.cu && ./ce_gather 32768
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); exit(1);} } while (0)

static const int LAYERS = 32, NBLK = 8192, SEL = 2048;

struct Pieces { std::vector<void*> src, dst; std::vector<size_t> sz; bool h2d; bool d2d; };

static void issue(Pieces& p, int nstreams, cudaStream_t* st) {
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  cudaMemLocation dev = {cudaMemLocationTypeDevice, 0}, host = {cudaMemLocationTypeHost, 0};
  attr.srcLocHint = p.h2d ? host : dev;
  attr.dstLocHint = (p.h2d || p.d2d) ? dev : host;
  size_t idx = 0, n = p.src.size(), per = (n + nstreams - 1) / nstreams;
  for (int s = 0; s < nstreams; s++) {
    size_t lo = s * per, hi = std::min(n, lo + per);
    for (size_t o = lo; o < hi; o += 8192) {
      size_t c = std::min((size_t)8192, hi - o);
      CK(cudaMemcpyBatchAsync(&p.dst[o], &p.src[o], &p.sz[o], c, &attr, &idx, 1, st[s]));
    }
  }
}

// run times one or two batches (each on its own nstreams streams), median of 5.
static float run(Pieces* a, Pieces* b, int nstreams, cudaStream_t* st) {
  std::vector<float> t;
  cudaEvent_t e0, e1, ev[16];
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int i = 0; i < 16; i++) CK(cudaEventCreate(&ev[i]));
  int used = b ? 2 * nstreams : nstreams;
  for (int r = 0; r < 6; r++) {
    CK(cudaDeviceSynchronize());
    CK(cudaEventRecord(e0, st[0]));
    for (int s = 1; s < used; s++) CK(cudaStreamWaitEvent(st[s], e0));
    issue(*a, nstreams, st);
    if (b) issue(*b, nstreams, st + nstreams);
    for (int s = 1; s < used; s++) { CK(cudaEventRecord(ev[s], st[s])); CK(cudaStreamWaitEvent(st[0], ev[s])); }
    CK(cudaEventRecord(e1, st[0])); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  size_t piece = argc > 1 ? atoll(argv[1]) : 32768;
  int kv = piece == 32768 ? 2 : 1;
  size_t per_layer = (size_t)NBLK * piece * kv;
  std::vector<char*> layer(LAYERS);
  for (int l = 0; l < LAYERS; l++) CK(cudaMalloc(&layer[l], per_layer));
  std::vector<int> ids(NBLK); for (int i = 0; i < NBLK; i++) ids[i] = i;
  std::mt19937 rng(1); std::shuffle(ids.begin(), ids.end(), rng);
  size_t total = (size_t)SEL * LAYERS * kv * piece;
  char *stage; CK(cudaMalloc(&stage, total));
  cudaStream_t st[16]; for (int s = 0; s < 16; s++) CK(cudaStreamCreateWithFlags(&st[s], cudaStreamNonBlocking));
  printf("piece %zu B, %d blocks of %d, %.2f GB each way\n", piece, SEL, NBLK, total / 1e9);
  for (int kind = 0; kind < 2; kind++) {
    char* host;
    if (kind == 0) CK(cudaMallocHost(&host, 2 * total));
    else {
      host = (char*)mmap(nullptr, 2 * total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      madvise(host, 2 * total, MADV_HUGEPAGE);
      CK(cudaHostRegister(host, 2 * total, cudaHostRegisterPortable | cudaHostRegisterMapped));
    }
    const char* kname = kind ? "mmap+register" : "cudaMallocHost";
    // save: blocks ids[0..SEL) -> host[0..total); load: host[total..2 total) -> blocks ids[SEL..2 SEL)
    Pieces save{}, load{}, gather{};
    save.h2d = false; load.h2d = true; gather.d2d = true;
    size_t off = 0;
    for (int i = 0; i < SEL; i++) for (int l = 0; l < LAYERS; l++) for (int k = 0; k < kv; k++) {
      char* s = layer[l] + (size_t)k * NBLK * piece + (size_t)ids[i] * piece;
      char* d = layer[l] + (size_t)k * NBLK * piece + (size_t)ids[SEL + i] * piece;
      save.src.push_back(s); save.dst.push_back(host + off); save.sz.push_back(piece);
      load.src.push_back(host + total + off); load.dst.push_back(d); load.sz.push_back(piece);
      gather.src.push_back(s); gather.dst.push_back(stage + off); gather.sz.push_back(piece);
      off += piece;
    }
    for (int ns : {1, 2, 4}) {
      float s = run(&save, nullptr, ns, st), l = run(&load, nullptr, ns, st), d = run(&save, &load, ns, st);
      printf("%-15s streams/dir=%d  offload %.1f  onboard %.1f  both ways %.1f GB/s\n", kname, ns,
             total / s / 1e6, total / l / 1e6, 2 * total / d / 1e6);
    }
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    float best[2] = {1e30f, 1e30f};
    for (int r = 0; r < 5; r++) for (int dir = 0; dir < 2; dir++) {
      CK(cudaEventRecord(a, st[0]));
      if (dir == 0) CK(cudaMemcpyAsync(host, stage, total, cudaMemcpyDeviceToHost, st[0]));
      else CK(cudaMemcpyAsync(stage, host + total, total, cudaMemcpyHostToDevice, st[0]));
      CK(cudaEventRecord(b, st[0])); CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b));
      best[dir] = std::min(best[dir], ms);
    }
    printf("%-15s one contiguous copy: offload %.1f  onboard %.1f GB/s\n", kname, total / best[0] / 1e6, total / best[1] / 1e6);
    if (kind == 0) printf("device gather of the same pieces (copy engines, D2D): %.1f GB/s\n", total / run(&gather, nullptr, 1, st) / 1e6);
    if (kind == 0) CK(cudaFreeHost(host)); else { CK(cudaHostUnregister(host)); munmap(host, 2 * total); }
  }
  return 0;
}
