// Decode / verification attention over a shared KV pool, for MLX's Metal backend
// (mx.fast.metal_kernel): the same computation, in the same order, as pooled_attention.cu
// (read that file's header; kernels/custom/attention_order.py is the specification).
// Simdgroups of 32 threads take the place of warps. Metal allows threadgroup arrays only in
// the kernel's own scope, so the body in kernels/custom/attention.py declares them and
// passes them in.

#include <metal_stdlib>
using namespace metal;

namespace lockstep {

constant constexpr int ATT_WARPS = 8;

template <typename T, int D>
inline float key_dot(threadgroup const float* q_s, const device T* key) {
  float dot = 0.0f;
  for (int d = 0; d < D; ++d) dot = fma(q_s[d], float(key[d]), dot);
  return dot;
}

template <typename T, int D>
inline void pooled_attention(const device T* q, const device T* k, const device T* v,
                             const device int* row_base, const device int* row_len,
                             const device float* scale_in, device T* out,
                             int heads, int rows, int kv_heads, int slots,
                             uint block, uint tid, uint warp, uint lane,
                             threadgroup float* q_s, threadgroup float* m_s,
                             threadgroup float* l_s, threadgroup float* acc_s) {
  constexpr int PER_LANE = D / 32;
  const int h = int(block) / rows;
  const int r = int(block) % rows;
  const int kvh = h / (heads / kv_heads);
  const int len = row_len[r];
  const long base = row_base[r];
  const float scale = scale_in[0];

  for (int d = int(tid); d < D; d += 32 * ATT_WARPS) q_s[d] = float(q[(long(h) * rows + r) * D + d]);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const device T* kh = k + long(kvh) * slots * D;
  const device T* vh = v + long(kvh) * slots * D;
  float m = -INFINITY, l = 0.0f;
  float acc[PER_LANE];
  for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.0f;

  const int tiles = (len + 31) / 32;
  for (int t = int(warp); t < tiles; t += ATT_WARPS) {
    const int j = t * 32 + int(lane);
    const bool valid = j < len;
    const float s = valid ? key_dot<T, D>(q_s, kh + (base + j) * D) * scale : -INFINITY;
    float tile_max = s;
    for (ushort off = 16; off > 0; off >>= 1) tile_max = fmax(tile_max, simd_shuffle_xor(tile_max, off));
    const float m_new = fmax(m, tile_max);
    const float p = valid ? exp(s - m_new) : 0.0f;
    const float corr = exp(m - m_new);
    float sum = p;
    for (ushort off = 16; off > 0; off >>= 1) sum += simd_shuffle_xor(sum, off);
    sum = simd_shuffle(sum, ushort(0));
    l = l * corr + sum;
    for (int i = 0; i < PER_LANE; ++i) acc[i] *= corr;
    const int in_tile = min(32, len - t * 32);
    for (int i = 0; i < in_tile; ++i) {
      const float p_i = simd_shuffle(p, ushort(i));
      const device T* vrow = vh + (base + t * 32 + i) * D;
      for (int c = 0; c < PER_LANE; ++c) acc[c] = fma(p_i, float(vrow[int(lane) + 32 * c]), acc[c]);
    }
    m = m_new;
  }

  if (lane == 0) {
    m_s[warp] = m;
    l_s[warp] = l;
  }
  for (int c = 0; c < PER_LANE; ++c) acc_s[int(warp) * D + int(lane) + 32 * c] = acc[c];
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int d = int(tid); d < D; d += 32 * ATT_WARPS) {
    float m_all = -INFINITY;
    for (int w = 0; w < ATT_WARPS; ++w) m_all = fmax(m_all, m_s[w]);
    float a = 0.0f, total = 0.0f;
    for (int w = 0; w < ATT_WARPS; ++w) {
      if (l_s[w] > 0.0f) {
        const float f = exp(m_s[w] - m_all);
        a = fma(acc_s[w * D + d], f, a);
        total = fma(l_s[w], f, total);
      }
    }
    out[(long(h) * rows + r) * D + d] = T(a / total);
  }
}

}  // namespace lockstep
