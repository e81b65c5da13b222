// The values both quantized GEMV kernels work with (qmv_rows.cu, qmv_split.cu; their loaders
// put fp_formats.cuh, then this file, before the kernel): pairs of T, conversions, and a
// code's or a group scale's value by format (FMT: 0 affine, 1 nvfp4, 2 mxfp4, 3 mxfp8).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep_quant {

template <typename T> struct Pair;
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ __half2 make_pair(__half a, __half b) { return __halves2half2(a, b); }
__device__ __forceinline__ __nv_bfloat162 make_pair(__nv_bfloat16 a, __nv_bfloat16 b) { return __halves2bfloat162(a, b); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ __half low_half(__half2 v) { return __low2half(v); }
__device__ __forceinline__ __nv_bfloat16 low_half(__nv_bfloat162 v) { return __low2bfloat16(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

// 2^(e - 127); e = 0 is a float32 subnormal.
__device__ __forceinline__ float ue8m0_to_float(uint32_t e) {
  return e == 0 ? 0x1p-127f : __uint_as_float(e << 23);
}

// A code's value, exact in T.
template <int FMT>
__device__ __forceinline__ float code_value(uint32_t q) {
  if constexpr (FMT == 0) return (float)q;
  else if constexpr (FMT == 3) return lockstep_fp::e4m3_to_float(q);
  else return lockstep_fp::e2m1_to_float(q);
}

// A group's scale as T (MLX: T(scale); e4m3 is exact in T, ue8m0 rounds through float32).
template <typename T, int FMT>
__device__ __forceinline__ T scale_value(const T* scales_t, const uint8_t* scales_u8, int g) {
  if constexpr (FMT == 0) return scales_t[g];
  else if constexpr (FMT == 1) return from_float<T>(lockstep_fp::e4m3_to_float(scales_u8[g]));
  else return from_float<T>(ue8m0_to_float(scales_u8[g]));
}

}  // namespace lockstep_quant
