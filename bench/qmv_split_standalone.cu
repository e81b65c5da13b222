// One row of an 8B-shaped nvfp4 linear (x bfloat16) through one instance of a 4-bit row
// kernel, outside MLX: for variants of a kernel's translation unit and for Nsight Compute,
// which profiles this process more easily than MLX's. Per shape: 16 unmeasured launches, then
// 256 back to back between two CUDA events, median of 5, rotating over copies of the weight
// that together exceed L2; a hash of the first copy's output tells whether a variant kept
// the bits. Random codes, finite e4m3 scales. Measures and prints; asserts nothing.
//
//   python bench/qmv_split_source.py --kernel qmv_split --n 14336 --k 4096 --out /tmp/k.cu
//   nvcc -O3 -arch=sm_90a -DKSRC='"/tmp/k.cu"' -DKNAME=<printed name> -DKC=4 \
//        bench/qmv_split_standalone.cu -o /tmp/h && /tmp/h [blocks] [shape]
//
// KC: the instance's outputs a block at a time (qmv_split's C); KCOLS / KTHREADS: columns a
// block takes and its threads, where they differ (qmv_mma: 8 * NT and 32 * WARPS). blocks:
// the grid's cap (qmv_split.MAX_BLOCKS); shape: one of q,o k,v gate down head.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cuda_runtime.h>
#include KSRC
#ifndef KTHREADS
#define KTHREADS 128
#endif
#ifndef KCOLS
#define KCOLS KC
#endif
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

static uint64_t lcg = 12345;
static uint32_t rnd() { lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL; return (uint32_t)(lcg >> 33); }

int main(int argc, char** argv) {
  int blocks_per = argc > 1 ? atoi(argv[1]) : 660;
  struct Shape { const char* name; int n, k; } shapes[] = {
    {"q,o", 4096, 4096}, {"k,v", 1024, 4096}, {"gate", 14336, 4096}, {"down", 4096, 14336}, {"head", 128256, 4096}};
  const char* only = argc > 2 ? argv[2] : nullptr;
  for (auto& s : shapes) {
    if (only && strcmp(only, s.name)) continue;
    const size_t wbytes = (size_t)s.n * s.k / 2, sbytes = (size_t)s.n * s.k / 16;
    const int copies = (int)((200ull << 20) / (wbytes + sbytes)) + 1;
    std::vector<uint32_t*> w(copies); std::vector<uint8_t*> sc(copies);
    std::vector<uint32_t> hw(wbytes / 4); std::vector<uint8_t> hs(sbytes);
    for (auto& v : hw) v = rnd();
    for (auto& v : hs) v = 0x28 + rnd() % 0x30;
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&w[c], wbytes)); CK(cudaMalloc(&sc[c], sbytes));
      CK(cudaMemcpy(w[c], hw.data(), wbytes, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sc[c], hs.data(), sbytes, cudaMemcpyHostToDevice));
    }
    std::vector<uint16_t> hx(s.k);
    for (auto& v : hx) { float f = ((int)(rnd() % 2001) - 1000) / 1000.0f; uint32_t b; memcpy(&b, &f, 4); v = b >> 16; }
    __nv_bfloat16 *x, *y; CK(cudaMalloc(&x, s.k * 2)); CK(cudaMalloc(&y, s.n * 2));
    CK(cudaMemcpy(x, hx.data(), s.k * 2, cudaMemcpyHostToDevice));
    int grid = (s.n + KCOLS - 1) / KCOLS; if (grid > blocks_per) grid = blocks_per;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    const int calls = 256;
    float times[5];
    for (int rep = 0; rep < 5; ++rep) {
      for (int i = 0; i < 16; ++i) KNAME<<<grid, KTHREADS>>>(x, w[i % copies], sc[i % copies], y, 1, s.n, s.k);
      cudaEventRecord(a);
      for (int i = 0; i < calls; ++i) KNAME<<<grid, KTHREADS>>>(x, w[i % copies], sc[i % copies], y, 1, s.n, s.k);
      cudaEventRecord(b); CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b); times[rep] = ms * 1000 / calls;
    }
    std::sort(times, times + 5);
    // checksum of the output of copy 0
    KNAME<<<grid, KTHREADS>>>(x, w[0], sc[0], y, 1, s.n, s.k); CK(cudaDeviceSynchronize());
    std::vector<uint16_t> hy(s.n); CK(cudaMemcpy(hy.data(), y, s.n * 2, cudaMemcpyDeviceToHost));
    uint64_t h = 1469598103934665603ULL; for (auto v : hy) { h ^= v; h *= 1099511628211ULL; }
    const double gbps = (wbytes + sbytes) / (times[2] * 1e-6) / 1e12;
    printf("%-5s %6dx%-6d C=%d grid=%4d  %8.2f us (min %.2f)  %.2f TB/s  hash %016llx\n", s.name, s.n, s.k, KC, grid, times[2], times[0], gbps,
           (unsigned long long)h);
    for (int c = 0; c < copies; ++c) { cudaFree(w[c]); cudaFree(sc[c]); }
    cudaFree(x); cudaFree(y);
  }
  return 0;
}
