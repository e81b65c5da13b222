// The two pool attention kernels outside MLX: kernels/custom/pooled_attention.cu (every pass's
// order, shared with Metal) against split_attention.cu (plain passes), 8B shape (32 query heads,
// 8 key heads of 128, bfloat16), one and four rows. Each case: the largest error of each
// against a float64 reference on the host, then 500 back-to-back launches between two CUDA
// events after 20 unmeasured, median of 5. "warm": every launch reads the same keys (in L2
// after the first); "cold": launches rotate over 24 key ranges of a 256 MB pool, as a decode
// step meets each layer's keys after the rest of the model has streamed through L2.
//
//   nvcc -O3 -arch=sm_90a bench/attention_standalone.cu -o attention_standalone && ./attention_standalone
//   (-DSRC='"variant.cu"' times a variant of split_attention.cu; -DCLUSTER one whose
//   kernel runs as clusters of 8 blocks)
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "../kernels/custom/pooled_attention.cu"
#ifndef SRC
#define SRC "../kernels/custom/split_attention.cu"
#endif
#include SRC

typedef __nv_bfloat16 T;
#ifdef CLUSTER
#define GRIDX 8
#else
#define GRIDX 1
#endif
constexpr int D = 128, HQ = 32, HKV = 8, S = 65536;

__global__ void pooled_k(const T* q, const T* k, const T* v, const int* b, const int* l, const float* sc, T* o, int rows) {
  lockstep::pooled_attention<T, D>(q, k, v, b, l, sc, o, HQ, rows, HKV, S);
}
#ifdef CLUSTER
__global__ void __cluster_dims__(8, 1, 1) split_k
#else
__global__ void split_k
#endif
(const T* q, const T* k, const T* v, const int* b, const int* l, const float* sc, T* o, int rows) {
  lockstep::split_attention<T, D>(q, k, v, b, l, sc, o, HQ, rows, HKV, S);
}

static float bf(T x) { return __bfloat162float(x); }

int main(int argc, char** argv) {
  std::vector<T> hk((size_t)HKV * S * D), hv(hk.size()), hq(HQ * 8 * D);
  srand(1);
  for (auto& x : hk) x = __float2bfloat16((rand() / (float)RAND_MAX - 0.5f) * 4);
  for (auto& x : hv) x = __float2bfloat16((rand() / (float)RAND_MAX - 0.5f) * 2);
  for (auto& x : hq) x = __float2bfloat16((rand() / (float)RAND_MAX - 0.5f) * 2);
  T *dq, *dk, *dv, *dout; int *db, *dl; float* dsc;
  cudaMalloc(&dq, hq.size() * 2); cudaMalloc(&dk, hk.size() * 2); cudaMalloc(&dv, hv.size() * 2);
  cudaMalloc(&dout, HQ * 8 * D * 2); cudaMalloc(&db, 64); cudaMalloc(&dl, 64); cudaMalloc(&dsc, 4);
  cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice);
  float sc = 1.f / sqrtf(D); cudaMemcpy(dsc, &sc, 4, cudaMemcpyHostToDevice);
  struct Case { int rows; int len[4]; int base[4]; };
  Case cases[] = {{1, {512}, {100}}, {1, {2048}, {3000}}, {1, {33}, {7}}, {1, {1}, {0}}, {4, {512, 1000, 17, 300}, {0, 600, 1700, 4000}}};
  int* dbs; cudaMalloc(&dbs, 24 * 16);
  for (int cold = 0; cold < 2; ++cold)
  for (auto& c : cases) {
    { std::vector<int> hb(24 * 4); for (int i = 0; i < 24; ++i) for (int r = 0; r < 4; ++r) hb[i * 4 + r] = c.base[r] + i * 2600; cudaMemcpy(dbs, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice); }
    if (cold && c.len[0] < 500) continue;
    cudaMemcpy(db, c.base, 16, cudaMemcpyHostToDevice); cudaMemcpy(dl, c.len, 16, cudaMemcpyHostToDevice);
    float err[2] = {0, 0}; float us[2];
    for (int which = 0; which < 2; ++which) {
      int rot = 0;
      auto launch = [&]() {
        const int* b = cold ? dbs + 4 * (rot++ % 24) : db;
        if (which == 0) pooled_k<<<HQ * c.rows, 256>>>(dq, dk, dv, b, dl, dsc, dout, c.rows);
        else split_k<<<HQ * c.rows * GRIDX, 32 * lockstep::SPLIT_WARPS>>>(dq, dk, dv, b, dl, dsc, dout, c.rows);
      };
      cudaMemset(dout, 0, HQ * 8 * D * 2);
      launch(); cudaDeviceSynchronize();
      cudaError_t e = cudaGetLastError(); if (e) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
      std::vector<T> ho(HQ * c.rows * D); cudaMemcpy(ho.data(), dout, ho.size() * 2, cudaMemcpyDeviceToHost);
      for (int h = 0; h < HQ; ++h) for (int r = 0; r < c.rows; ++r) {
        int kvh = h / (HQ / HKV); std::vector<double> s(c.len[r]); double mx = -1e30;
        for (int j = 0; j < c.len[r]; ++j) { double d = 0; for (int x = 0; x < D; ++x) d += bf(hq[(h * c.rows + r) * D + x]) * bf(hk[((size_t)kvh * S + c.base[r] + j) * D + x]); s[j] = d * sc; mx = std::max(mx, s[j]); }
        double tot = 0; for (auto& x : s) { x = exp(x - mx); tot += x; }
        for (int x = 0; x < D; ++x) { double a = 0; for (int j = 0; j < c.len[r]; ++j) a += s[j] * bf(hv[((size_t)kvh * S + c.base[r] + j) * D + x]); a /= tot;
          err[which] = std::max(err[which], (float)fabs(a - bf(ho[(h * c.rows + r) * D + x]))); }
      }
      cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      std::vector<float> t;
      for (int rep = 0; rep < 5; ++rep) {
        for (int i = 0; i < 20; ++i) launch();
        cudaEventRecord(a); for (int i = 0; i < 500; ++i) launch(); cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms * 1e3f / 500);
      }
      std::sort(t.begin(), t.end()); us[which] = t[2];
    }
    printf("%s rows %d len %5d: pooled %6.2f us (err %.2e)  split %6.2f us (err %.2e)\n", cold ? "cold" : "warm", c.rows, c.len[0], us[0], err[0], us[1], err[1]);
  }
  return 0;
}
