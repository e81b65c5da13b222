// Rows of x times a 4-bit quantized weight on tensor cores, K split across a block's warps,
// for MLX's CUDA backend: lockstep's own order, made so that one row and sixteen rows cost
// about the same (each weight is loaded and dequantized once for all of a block's rows).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]    x: (M, K) of T (float16, bfloat16); W: (N, K) 4-bit
//                                        codes packed in uint32 words, lowest bits first
//
// The order, for every output alike (index model: kernels/custom/qmv_mma_order.py):
// - a weight is code * scale in T (affine: code * scale, then + bias, each rounded to T);
// - K is cut into chunks of 128 codes; chunk c is run by warp c % WARPS of the block, in
//   increasing c; in a chunk, lane group q = lane % 4 holds codes q * 32 .. q * 32 + 31 of
//   column lane / 4 (one 16-byte load) and the same elements of x's rows lane / 4 and
//   lane / 4 + 8 of the tile;
// - MMA j (0..7) of a chunk puts elements q * 32 + 4j + (0, 1) in its k slots 2q, 2q + 1
//   and q * 32 + 4j + (2, 3) in slots 2q + 8, 2q + 9, in A (x) and B (W) alike: a 16-term
//   dot product added to the warp's float32 accumulator (m16n8k16, the tensor core's own
//   rounding);
// - the warps' sums are added in warp order 0, 1, .., WARPS - 1 and rounded to T.
// An MMA's row m depends on that row of A alone, so a row's bits are a function of its own
// x row, the weight, K and WARPS (a function of the layer's shape), never of M or of where
// the row sits in its tile (the smoke test and the startup self-test prove it on the GPU).
//
// Template arguments (set by kernels/custom/qmv_mma.py): T; FMT: 0 affine (a T scale and
// bias per GROUP of 32, 64 or 128), 1 nvfp4 (e2m1 codes, an e4m3 scale per 16), 2 mxfp4
// (e2m1, a ue8m0 scale per 32); GROUP; WARPS (the K split: order); NT column tiles of 8 a
// warp, ROWS rows a block (8, 16 or 32), DEPTH chunks loaded ahead and CG (0: each warp loads
// its x rows from global memory; 1 or more: the block stages them in shared memory once for CG
// column groups of WARPS warps, see qmv_mma_staged_tile); none of the four changes an
// output's order.

namespace lockstep_qmma {

using namespace lockstep_quant;

// d += A (16 x 16, row) * B (16 x 8, col), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                   uint32_t b0, uint32_t b1) {
  if constexpr (IsHalf<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

template <typename T2>
__device__ __forceinline__ uint32_t bits_of(T2 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

// How a block of ROWS rows turns a byte's two codes (low nibble first) into a T pair: the
// values are exact in T either way, so neither changes a bit. Blocks of 32 rows place the bits
// (quant_values.cuh's codes_as_pair): each pair feeds two MMAs there, and a table's reads would
// queue with x's loads on the L1/TEX pipe. Smaller blocks read a table in shared memory, one
// load where the placement takes several instructions; from 16 rows one copy of it a lane
// (entry byte * 32 + lane), so a lane's reads all fall in its own bank, where 32 lanes reading
// random bytes of one copy queue on shared banks (at 8 rows filling 32 copies did not pay).
template <int ROWS>
struct CodeTable {
  static constexpr bool BY_BITS = ROWS >= 32;
  static constexpr int COPIES = ROWS >= 16 ? 32 : 1;
  static constexpr int BYTES = BY_BITS ? 0 : 256 * COPIES * 4;
};

// The block's threads fill the table (none where the block places bits); the caller's barrier
// publishes it.
template <typename T, int FMT, int ROWS>
__device__ __forceinline__ void fill_code_table(typename Pair<T>::type* table) {
  using C = CodeTable<ROWS>;
  if constexpr (!C::BY_BITS) {
    for (int i = threadIdx.x; i < 256 * C::COPIES; i += blockDim.x) {
      const int e = i / C::COPIES;
      table[i] = make_pair(from_float<T>(code_value<FMT>(e & 15)), from_float<T>(code_value<FMT>(e >> 4)));
    }
  }
}

// The T pair of the low byte of `bytes` (the higher bytes ignored), decoded the block's way.
template <typename T, int FMT, int ROWS>
__device__ __forceinline__ typename Pair<T>::type code_pair(const typename Pair<T>::type* table, uint32_t bytes,
                                                            int lane) {
  using C = CodeTable<ROWS>;
  if constexpr (C::BY_BITS) return codes_as_pair<T, FMT>(bytes);
  else return table[(bytes & 0xFFu) * C::COPIES + (C::COPIES > 1 ? lane : 0)];
}

// Lane group g's column of each of the NT column tiles of 8 from n0 (past N: column N - 1,
// read but never stored).
template <int NT>
__device__ __forceinline__ void lane_columns(int (&col)[NT], int n0, int g, int N) {
#pragma unroll
  for (int c = 0; c < NT; ++c) col[c] = min(n0 + 8 * c + g, N - 1);
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int c = 0; c < NT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][c][i] = 0.0f;
}

// The lane's 32 codes at k of each of its NT columns, and their groups' scales (and biases).
template <typename T, int FMT, int GROUP, int NT, int SCALES>
__device__ __forceinline__ void chunk_weights(uint4 (&codes)[NT], T (&scale)[NT][SCALES], T (&bias)[NT],
                                              const uint32_t* w, const T* scales_t, const uint8_t* scales_u8,
                                              const T* biases, const int (&col)[NT], int k, int words, int groups) {
#pragma unroll
  for (int c = 0; c < NT; ++c) {
    codes[c] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)col[c] * words + (k >> 3)));
    const int gi = col[c] * groups + k / GROUP;
    scale_values<T, FMT, SCALES>(scale[c], scales_t, scales_u8, gi);
    if constexpr (FMT == 0) bias[c] = biases[gi];
  }
}

// Column tile `tile` (8 * NT columns) of the block's ROWS rows.
template <typename T, int FMT, int GROUP, int WARPS, int NT, int ROWS, int DEPTH>
__device__ __forceinline__ void qmv_mma_tile(const T* x, const uint32_t* w, const T* scales_t,
                                             const uint8_t* scales_u8, const T* biases, T* y, int M, int N,
                                             int K, int tile) {
  using T2 = typename Pair<T>::type;
  constexpr int CHUNK = 128;              // codes of a column a warp takes at a time
  constexpr int MT = (ROWS + 15) / 16;    // 16-row tiles
  constexpr int HALVES = ROWS >= 16 ? 2 : 1;  // rows g and g + 8 of a tile (8 rows: g only)
  constexpr int SCALES = GROUP == 16 ? 2 : 1;  // groups a lane's 32 codes span
  // The code table; the warps' sums (partial) reuse its bytes once every warp is past its loop.
  constexpr int PARTIAL_BYTES = WARPS * MT * NT * 128 * 4;
  constexpr int TABLE_BYTES = CodeTable<ROWS>::BYTES;
  __shared__ __align__(16) unsigned char smem[TABLE_BYTES > PARTIAL_BYTES ? TABLE_BYTES : PARTIAL_BYTES];
  T2* table = reinterpret_cast<T2*>(smem);
  float (*partial)[MT * NT * 128] = reinterpret_cast<float (*)[MT * NT * 128]>(smem);
  fill_code_table<T, FMT, ROWS>(table);
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = tile * 8 * NT;
  const int m0 = blockIdx.y * ROWS;
  const int chunks = K / CHUNK;
  const int groups = K / GROUP;
  const int words = K >> 3;

  int col[NT];
  lane_columns(col, n0, g, N);
  const T* xrow[MT][HALVES];
  bool live[MT][HALVES];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      const int m = m0 + 16 * t + 8 * h + g;
      live[t][h] = 16 * t + 8 * h < ROWS && m < M;
      xrow[t][h] = x + (size_t)min(m, M - 1) * K;
    }

  float acc[MT][NT][4];
  zero(acc);

#pragma unroll 1
  for (int c0 = warp; c0 < chunks; c0 += WARPS * DEPTH) {
    uint4 codes[DEPTH][NT];
    T scale[DEPTH][NT][SCALES];
    T bias[DEPTH][NT];
    uint4 xv[DEPTH][MT][HALVES][4];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int ch = c0 + d * WARPS;
      if (ch >= chunks) break;
      const int k = ch * CHUNK + q * 32;
      chunk_weights<T, FMT, GROUP, NT, SCALES>(codes[d], scale[d], bias[d], w, scales_t, scales_u8, biases, col, k,
                                              words, groups);
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
#pragma unroll
          for (int v = 0; v < 4; ++v)
            xv[d][t][h][v] = live[t][h] ? __ldg(reinterpret_cast<const uint4*>(xrow[t][h] + k) + v)
                                        : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (c0 + d * WARPS >= chunks) break;
#pragma unroll
      for (int c = 0; c < NT; ++c) {
        // the lane's 16 bytes as 16 T pairs: byte i holds elements 2i, 2i + 1 of its 32
        const uint32_t wd[4] = {codes[d][c].x, codes[d][c].y, codes[d][c].z, codes[d][c].w};
        uint32_t b[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const T s = scale[d][c][SCALES == 2 ? i / 8 : 0];
          T2 v = __hmul2_rn(code_pair<T, FMT, ROWS>(table, wd[i >> 2] >> (8 * (i & 3)), lane), make_pair(s, s));
          if constexpr (FMT == 0) v = __hadd2_rn(v, make_pair(bias[d][c], bias[d][c]));
          b[i] = bits_of(v);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const uint32_t* lo = reinterpret_cast<const uint32_t*>(&xv[d][t][0][0]);
            const uint32_t* hi = reinterpret_cast<const uint32_t*>(&xv[d][t][HALVES - 1][0]);
            mma<T>(acc[t][c], lo[2 * j], HALVES == 2 ? hi[2 * j] : 0u, lo[2 * j + 1],
                   HALVES == 2 ? hi[2 * j + 1] : 0u, b[2 * j], b[2 * j + 1]);
          }
      }
    }
  }

  // The warps' sums in warp order; every thread adds up some of the block's outputs.
  __syncthreads();  // every warp is past its table reads before partial takes their bytes
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int c = 0; c < NT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][((t * NT + c) * 32 + lane) * 4 + i] = acc[t][c][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < MT * NT * 128; idx += WARPS * 32) {
    float s = partial[0][idx];
#pragma unroll
    for (int v = 1; v < WARPS; ++v) s = __fadd_rn(s, partial[v][idx]);
    const int i = idx & 3, l = (idx >> 2) & 31, tc = idx >> 7;
    const int t = tc / NT, c = tc % NT;
    const int row = 16 * t + (l >> 2) + (i >= 2 ? 8 : 0);
    const int m = m0 + row, n = n0 + 8 * c + 2 * (l & 3) + (i & 1);
    if (row < ROWS && m < M && n < N) y[(size_t)m * N + n] = from_float<T>(s);
  }
}

// The staged tile's shared memory in bytes (kernels/custom/qmv_mma.py computes the same
// figure for the launch): the code table and a round's x slab, whose bytes the warps' partial
// sums take once every warp is past its loop.
template <int WARPS, int NT, int ROWS, int DEPTH, int CG>
struct Staged {
  static constexpr int MT = (ROWS + 15) / 16;
  static constexpr int TABLE_BYTES = CodeTable<ROWS>::BYTES;
  static constexpr int UNITS = WARPS * DEPTH * 16;  // 16-byte units of a slab row: a round's chunks
  static constexpr int SLAB_BYTES = ROWS * UNITS * 16;
  static constexpr int PARTIAL_BYTES = CG * WARPS * MT * NT * 128 * 4;
  static constexpr int BYTES =
      TABLE_BYTES + SLAB_BYTES > PARTIAL_BYTES ? TABLE_BYTES + SLAB_BYTES : PARTIAL_BYTES;
};

// Where 16-byte unit u of slab row r lies: lane (g, q) reads unit 4q + v of its chunk from rows
// g and g + 8, and the xor spreads the 8 lanes of one shared-memory phase (g = 0, 1; q = 0..3)
// over 8 distinct bank groups, so a load takes no conflicts.
__device__ __forceinline__ int staged_unit(int r, int u) {
  return u ^ ((r & 1) | (((u >> 3) & 1) << 1));
}

// qmv_mma_tile's outputs, bit for bit, from a block of CG column groups of WARPS warps: each
// round the block copies x's rows for the next WARPS * DEPTH chunks into shared memory once
// (cp.async, 16 bytes a thread at a time, along the rows), and every warp reads its chunk's x
// from there, where qmv_mma_tile's warps each read theirs from global memory in 16-byte pieces
// spread over 8 rows and 2 cache lines a row. Warp w of column group cg runs chunk c of its
// columns where c % WARPS == w, in increasing c, and an MMA takes the same A and B registers as
// in qmv_mma_tile (the MMAs of an accumulator in the same sequence): the same order, so the same
// bits. `tile` counts blocks of CG * 8 * NT columns.
template <typename T, int FMT, int GROUP, int WARPS, int NT, int ROWS, int DEPTH, int CG>
__device__ __forceinline__ void qmv_mma_staged_tile(const T* x, const uint32_t* w, const T* scales_t,
                                                    const uint8_t* scales_u8, const T* biases, T* y, int M, int N,
                                                    int K, int tile) {
  using T2 = typename Pair<T>::type;
  using L = Staged<WARPS, NT, ROWS, DEPTH, CG>;
  constexpr int CHUNK = 128;
  constexpr int MT = L::MT;
  constexpr int HALVES = ROWS >= 16 ? 2 : 1;
  constexpr int SCALES = GROUP == 16 ? 2 : 1;
  constexpr int UNITS = L::UNITS;
  extern __shared__ __align__(16) unsigned char staged_smem[];
  T2* table = reinterpret_cast<T2*>(staged_smem);
  uint4* slab = reinterpret_cast<uint4*>(staged_smem + L::TABLE_BYTES);
  float* partial = reinterpret_cast<float*>(staged_smem);
  fill_code_table<T, FMT, ROWS>(table);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kw = warp % WARPS, cg = warp / WARPS;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = (tile * CG + cg) * 8 * NT;
  const int m0 = blockIdx.y * ROWS;
  const int chunks = K / CHUNK;
  const int groups = K / GROUP;
  const int words = K >> 3;

  int col[NT];
  lane_columns(col, n0, g, N);
  bool live[MT][HALVES];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int h = 0; h < HALVES; ++h) live[t][h] = 16 * t + 8 * h < ROWS && m0 + 16 * t + 8 * h + g < M;

  float acc[MT][NT][4];
  zero(acc);

#pragma unroll 1
  for (int r0 = 0; r0 < chunks; r0 += WARPS * DEPTH) {
    // The round's x: rows m0 .. m0 + ROWS - 1 (past M: row M - 1, never stored), chunks r0 ..
    const int round_units = min(WARPS * DEPTH, chunks - r0) * 16;
    for (int i = threadIdx.x; i < ROWS * UNITS; i += blockDim.x) {
      const int r = i / UNITS, u = i % UNITS;
      if (u >= round_units) continue;
      const T* src = x + (size_t)min(m0 + r, M - 1) * K + r0 * CHUNK + u * 8;
      const unsigned dst = (unsigned)__cvta_generic_to_shared(slab + r * UNITS + staged_unit(r, u));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
    }
    asm volatile("cp.async.commit_group;\n" ::);
    // the weights of this warp's chunks meanwhile
    uint4 codes[DEPTH][NT];
    T scale[DEPTH][NT][SCALES];
    T bias[DEPTH][NT];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int ch = r0 + d * WARPS + kw;
      if (ch >= chunks) break;
      const int k = ch * CHUNK + q * 32;
      chunk_weights<T, FMT, GROUP, NT, SCALES>(codes[d], scale[d], bias[d], w, scales_t, scales_u8, biases, col, k,
                                              words, groups);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // the slab (and, the first time, the table) is written
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (r0 + d * WARPS + kw >= chunks) break;
      const int unit0 = (d * WARPS + kw) * 16 + q * 4;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        // x elements q * 32 + 8v .. + 7 of the tile's rows g and g + 8: MMAs 2v and 2v + 1
        uint4 xv[MT][HALVES];
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
          for (int h = 0; h < HALVES; ++h) {
            const int r = 16 * t + 8 * h + g;
            xv[t][h] = live[t][h] ? slab[r * UNITS + staged_unit(r, unit0 + v)] : make_uint4(0u, 0u, 0u, 0u);
          }
#pragma unroll
        for (int c = 0; c < NT; ++c) {
          const uint32_t word = v == 0 ? codes[d][c].x : v == 1 ? codes[d][c].y : v == 2 ? codes[d][c].z
                                                                                           : codes[d][c].w;
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * v + jj;
            uint32_t b[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 2 * j + e;  // the byte of the lane's 16: elements 2i, 2i + 1
              const T s = scale[d][c][SCALES == 2 ? i / 8 : 0];
              T2 val = __hmul2_rn(code_pair<T, FMT, ROWS>(table, word >> (8 * (i & 3)), lane), make_pair(s, s));
              if constexpr (FMT == 0) val = __hadd2_rn(val, make_pair(bias[d][c], bias[d][c]));
              b[e] = bits_of(val);
            }
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              const uint32_t* lo = reinterpret_cast<const uint32_t*>(&xv[t][0]);
              const uint32_t* hi = reinterpret_cast<const uint32_t*>(&xv[t][HALVES - 1]);
              mma<T>(acc[t][c], lo[2 * jj], HALVES == 2 ? hi[2 * jj] : 0u, lo[2 * jj + 1],
                     HALVES == 2 ? hi[2 * jj + 1] : 0u, b[0], b[1]);
            }
          }
        }
      }
    }
    __syncthreads();  // every warp is past the slab before the next round overwrites it
  }

  // The warps' sums of each column group in warp order, as in qmv_mma_tile.
  constexpr int OUTS = MT * NT * 128;
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int c = 0; c < NT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[(cg * WARPS + kw) * OUTS + ((t * NT + c) * 32 + lane) * 4 + i] = acc[t][c][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < CG * OUTS; idx += blockDim.x) {
    const int group = idx / OUTS, o = idx % OUTS;
    const float* p = partial + group * WARPS * OUTS + o;
    float s = p[0];
#pragma unroll
    for (int v = 1; v < WARPS; ++v) s = __fadd_rn(s, p[v * OUTS]);
    const int i = o & 3, l = (o >> 2) & 31, tc = o >> 7;
    const int t = tc / NT, c = tc % NT;
    const int row = 16 * t + (l >> 2) + (i >= 2 ? 8 : 0);
    const int m = m0 + row, n = (tile * CG + group) * 8 * NT + 8 * c + 2 * (l & 3) + (i & 1);
    if (row < ROWS && m < M && n < N) y[(size_t)m * N + n] = from_float<T>(s);
  }
}

// Column tile `tile` of this launch: CG 0 qmv_mma_tile (tiles of 8 * NT columns), else the
// staged tile (tiles of CG * 8 * NT columns).
template <typename T, int FMT, int GROUP, int WARPS, int NT, int ROWS, int DEPTH, int CG>
__device__ __forceinline__ void qmv_mma_any_tile(const T* x, const uint32_t* w, const T* scales_t,
                                                 const uint8_t* scales_u8, const T* biases, T* y, int M, int N,
                                                 int K, int tile) {
  if constexpr (CG == 0)
    qmv_mma_tile<T, FMT, GROUP, WARPS, NT, ROWS, DEPTH>(x, w, scales_t, scales_u8, biases, y, M, N, K, tile);
  else
    qmv_mma_staged_tile<T, FMT, GROUP, WARPS, NT, ROWS, DEPTH, CG>(x, w, scales_t, scales_u8, biases, y, M, N, K,
                                                                   tile);
}

template <typename T, int FMT, int GROUP, int WARPS, int NT, int ROWS, int DEPTH, int CG>
__device__ void qmv_mma(const T* x, const uint32_t* w, const T* scales_t, const uint8_t* scales_u8,
                        const T* biases, T* y, int M, int N, int K) {
  qmv_mma_any_tile<T, FMT, GROUP, WARPS, NT, ROWS, DEPTH, CG>(x, w, scales_t, scales_u8, biases, y, M, N, K,
                                                              blockIdx.x);
}

// Up to three layers that read the same x (an attention block's q, k and v; an MLP's gate and
// up) in one launch: the column tiles of part 0, then part 1's, then part 2's (N2 = 0: two
// parts). Each part's outputs are computed exactly as its own qmv_mma call computes them (the
// same WARPS: kernels/custom/qmv_mma_parts.py launches only parts that share it). The block
// picks its part's arrays, then runs the one copy of the tile's code: a copy a part made the
// cubin, whose bytes MLX hashes at every launch, up to three times as large.
template <typename T, int FMT, int GROUP, int WARPS, int NT, int ROWS, int DEPTH, int CG>
__device__ void qmv_mma_parts(const T* x, int M, int K,
                              const uint32_t* w0, const T* st0, const uint8_t* su0, const T* b0, T* y0, int N0,
                              const uint32_t* w1, const T* st1, const uint8_t* su1, const T* b1, T* y1, int N1,
                              const uint32_t* w2, const T* st2, const uint8_t* su2, const T* b2, T* y2, int N2) {
  constexpr int COLS = 8 * NT * (CG > 0 ? CG : 1);
  const int t0 = (N0 + COLS - 1) / COLS, t1 = (N1 + COLS - 1) / COLS;
  int tile = blockIdx.x;
  const bool first = tile < t0, second = !first && tile < t0 + t1;
  if (!first && !second && N2 == 0) return;
  tile -= first ? 0 : second ? t0 : t0 + t1;
  qmv_mma_any_tile<T, FMT, GROUP, WARPS, NT, ROWS, DEPTH, CG>(
      x, first ? w0 : second ? w1 : w2, first ? st0 : second ? st1 : st2, first ? su0 : second ? su1 : su2,
      first ? b0 : second ? b1 : b2, first ? y0 : second ? y1 : y2, M, first ? N0 : second ? N1 : N2, K, tile);
}

}  // namespace lockstep_qmma
