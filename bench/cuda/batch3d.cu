// 3D batched-DMA probe (cudaMemcpy3DBatchAsync, CUDA >= 12.8): one copy-engine
// descriptor per block (chunk × K/V × layers, pitched on the G1 side) instead of
// one per 32 KiB piece, for vLLM's FlashAttention layout with the layers'
// tensors back to back; one way and both ways at once, against one contiguous
// copy of the same bytes. Host side is mmap'ed and registered as kvbm's G2 is.
//   nvcc -O2 -arch=sm_90 -o batch3d batch3d.cu && ./batch3d
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); exit(1);} } while (0)

static const int LAYERS = 32, NBLK = 8192, SEL = 2048, OUTER = 2;
static const size_t CHUNK = 32768, BLOCK = LAYERS * OUTER * CHUNK;

static cudaMemcpy3DOperand ptrop(void* p, size_t row, size_t h, bool dev) {
  cudaMemcpy3DOperand o = {};
  o.type = cudaMemcpyOperandTypePointer;
  o.op.ptr.ptr = p; o.op.ptr.rowLength = row; o.op.ptr.layerHeight = h;
  o.op.ptr.locHint.type = dev ? cudaMemLocationTypeDevice : cudaMemLocationTypeHost; o.op.ptr.locHint.id = 0;
  return o;
}

// ops for blocks g1[i] <-> host + i*BLOCK; depth = layers per op (LAYERS: one op a block; 1: one op per block and layer).
static std::vector<cudaMemcpy3DBatchOp> make(char* g1, char* host, const int* ids, bool h2d, int depth) {
  std::vector<cudaMemcpy3DBatchOp> v;
  for (int i = 0; i < SEL; i++) for (int l = 0; l < LAYERS; l += depth) {
    cudaMemcpy3DBatchOp op = {};
    char* g = g1 + (size_t)l * OUTER * NBLK * CHUNK + (size_t)ids[i] * CHUNK;
    char* h = host + (size_t)i * BLOCK + (size_t)l * OUTER * CHUNK;
    cudaMemcpy3DOperand go = ptrop(g, NBLK * CHUNK, OUTER, true), ho = ptrop(h, CHUNK, OUTER, false);
    op.src = h2d ? ho : go; op.dst = h2d ? go : ho;
    op.extent = make_cudaExtent(CHUNK, OUTER, depth);
    op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    op.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    v.push_back(op);
  }
  return v;
}

static void issue(std::vector<cudaMemcpy3DBatchOp>& ops, int ns, cudaStream_t* st) {
  size_t n = ops.size(), per = (n + ns - 1) / ns;
  for (int s = 0; s < ns; s++) {
    size_t lo = s * per, hi = std::min(n, lo + per);
    for (size_t o = lo; o < hi; o += 4096) CK(cudaMemcpy3DBatchAsync(std::min((size_t)4096, hi - o), &ops[o], 0, st[s]));
  }
}

static float run(std::vector<cudaMemcpy3DBatchOp>* a, std::vector<cudaMemcpy3DBatchOp>* b, int ns, cudaStream_t* st) {
  std::vector<float> t; cudaEvent_t e0, e1, ev[16];
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); for (int i = 0; i < 16; i++) CK(cudaEventCreate(&ev[i]));
  int used = b ? 2 * ns : ns;
  for (int r = 0; r < 6; r++) {
    CK(cudaDeviceSynchronize()); CK(cudaEventRecord(e0, st[0]));
    for (int s = 1; s < used; s++) CK(cudaStreamWaitEvent(st[s], e0));
    issue(*a, ns, st); if (b) issue(*b, ns, st + ns);
    for (int s = 1; s < used; s++) { CK(cudaEventRecord(ev[s], st[s])); CK(cudaStreamWaitEvent(st[0], ev[s])); }
    CK(cudaEventRecord(e1, st[0])); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r) t.push_back(ms);
  }
  std::sort(t.begin(), t.end()); return t[t.size() / 2];
}

int main() {
  char* g1; CK(cudaMalloc(&g1, (size_t)LAYERS * OUTER * NBLK * CHUNK));
  CK(cudaMemset(g1, 7, (size_t)LAYERS * OUTER * NBLK * CHUNK));
  std::vector<int> ids(NBLK); for (int i = 0; i < NBLK; i++) ids[i] = i;
  std::mt19937 rng(1); std::shuffle(ids.begin(), ids.end(), rng);
  size_t total = (size_t)SEL * BLOCK;
  char* host = (char*)mmap(nullptr, 2 * total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(host, 2 * total, MADV_HUGEPAGE);
  CK(cudaHostRegister(host, 2 * total, cudaHostRegisterPortable | cudaHostRegisterMapped));
  cudaStream_t st[16]; for (int s = 0; s < 16; s++) CK(cudaStreamCreateWithFlags(&st[s], cudaStreamNonBlocking));
  printf("FlashAttention layout, %d random blocks of %d, %.2f GB each way\n", SEL, NBLK, total / 1e9);
  for (int depth : {LAYERS, 1}) {
    auto save = make(g1, host, ids.data(), false, depth), load = make(g1, host + total, ids.data() + SEL, true, depth);
    for (int ns : {1, 2, 4}) {
      float s = run(&save, nullptr, ns, st), l = run(&load, nullptr, ns, st), d = run(&save, &load, ns, st);
      printf("3D batch, %s streams/dir=%d: offload %.1f  onboard %.1f  both ways %.1f GB/s\n",
             depth == LAYERS ? "one op a block (2 MiB)  " : "one op a layer (2x32 KiB)", ns, total / s / 1e6, total / l / 1e6, 2 * total / d / 1e6);
    }
  }
  // Mixed: a share of the blocks by 3D batch on one stream while the rest of the
  // bytes move as one contiguous copy from a device buffer on another (what a
  // staged slot's DMA is), one way and both ways.
  {
    char* dstage; CK(cudaMalloc(&dstage, total));
    for (int pct : {50, 60, 70, 80}) {
      int nb = SEL * pct / 100;
      auto save = make(g1, host, ids.data(), false, LAYERS), load = make(g1, host + total, ids.data() + SEL, true, LAYERS);
      save.resize(nb); load.resize(nb);
      size_t rest = (size_t)(SEL - nb) * BLOCK;
      float t[3];
      for (int mode = 0; mode < 3; mode++) {
        std::vector<float> v; cudaEvent_t e0, e1, ev[8];
        CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); for (int i = 0; i < 8; i++) CK(cudaEventCreate(&ev[i]));
        for (int r = 0; r < 6; r++) {
          CK(cudaDeviceSynchronize()); CK(cudaEventRecord(e0, st[0]));
          for (int s = 1; s < 8; s++) CK(cudaStreamWaitEvent(st[s], e0));
          if (mode != 1) { issue(save, 2, st); CK(cudaMemcpyAsync(host + (size_t)nb * BLOCK, dstage, rest, cudaMemcpyDeviceToHost, st[2])); }
          if (mode != 0) { issue(load, 2, st + 4); CK(cudaMemcpyAsync(dstage, host + total + (size_t)nb * BLOCK, rest, cudaMemcpyHostToDevice, st[6])); }
          for (int s = 1; s < 8; s++) { CK(cudaEventRecord(ev[s], st[s])); CK(cudaStreamWaitEvent(st[0], ev[s])); }
          CK(cudaEventRecord(e1, st[0])); CK(cudaEventSynchronize(e1));
          float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r) v.push_back(ms);
        }
        std::sort(v.begin(), v.end()); t[mode] = v[v.size() / 2];
      }
      printf("mixed %d%% 3D batch + %d%% contiguous: offload %.1f  onboard %.1f  both ways %.1f GB/s\n", pct, 100 - pct,
             total / t[0] / 1e6, total / t[1] / 1e6, 2 * total / t[2] / 1e6);
    }
  }
  // correctness: offload with one op a block, compare against per-piece copies.
  auto save = make(g1, host, ids.data(), false, LAYERS);
  CK(cudaMemset(g1 + (size_t)ids[3] * CHUNK, 42, CHUNK));                            // layer 0 K of block 3
  CK(cudaMemset(g1 + (size_t)(31 * 2 + 1) * NBLK * CHUNK + (size_t)ids[3] * CHUNK, 43, CHUNK)); // layer 31 V
  issue(save, 1, st); CK(cudaDeviceSynchronize());
  char* b3 = host + 3 * BLOCK;
  printf("check: layer0 K %d, layer0 V %d, layer31 V %d (want 42 7 43)\n", b3[0], b3[CHUNK], b3[BLOCK - 1]);
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  float best[2] = {1e30f, 1e30f};
  for (int r = 0; r < 5; r++) for (int dir = 0; dir < 2; dir++) {
    CK(cudaEventRecord(a, st[0]));
    if (dir == 0) CK(cudaMemcpyAsync(host, g1, total, cudaMemcpyDeviceToHost, st[0]));
    else CK(cudaMemcpyAsync(g1, host + total, total, cudaMemcpyHostToDevice, st[0]));
    CK(cudaEventRecord(b, st[0])); CK(cudaEventSynchronize(b)); float ms; CK(cudaEventElapsedTime(&ms, a, b));
    best[dir] = std::min(best[dir], ms);
  }
  printf("one contiguous copy: offload %.1f  onboard %.1f GB/s\n", total / best[0] / 1e6, total / best[1] / 1e6);
  return 0;
}
