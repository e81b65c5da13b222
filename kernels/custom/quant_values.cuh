// The values lockstep's quantized row kernels work with (qmv_rows.cu, qmv_split.cu, qmv_mma.cu;
// their loaders put fp_formats.cuh, then this file, before the kernel): pairs of T,
// conversions, and a code's or a group scale's value by format (FMT: 0 affine, 1 nvfp4,
// 2 mxfp4, 3 mxfp8).

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

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

template <typename T>
__device__ __forceinline__ typename Pair<T>::type pair_of_bits(uint32_t bits) {
  return *reinterpret_cast<const typename Pair<T>::type*>(&bits);
}

// The two 4-bit codes of a byte (low nibble first) as a T pair, exactly the values code_value
// gives, by bit placement instead of a table lookup (4-bit formats: FMT 0, 1, 2). Affine: code q
// in the low mantissa bits of 2^10 (float16) or 2^7 (bfloat16), less that power of 2. e2m1: the
// sign to T's sign bit, the two exponent bits and the mantissa bit to the bottom of T's exponent
// and the top of its mantissa, which reads as the value times 2^(1 - T's exponent bias) (0.5 a
// subnormal); one multiply by 2^(bias - 1) restores it. Each step is exact.
template <typename T, int FMT>
__device__ __forceinline__ typename Pair<T>::type codes_as_pair(uint32_t byte) {
  constexpr bool HALF = IsHalf<T>::value;
  const uint32_t codes = (byte & 0xFu) | ((byte & 0xF0u) << 12);  // each in its half's low 4 bits
  if constexpr (FMT == 0) {
    constexpr uint32_t BASE = HALF ? 0x64006400u : 0x43004300u;  // 1024 or 128, twice
    constexpr uint32_t MINUS = HALF ? 0xE400E400u : 0xC300C300u;
    return __hadd2_rn(pair_of_bits<T>(codes | BASE), pair_of_bits<T>(MINUS));
  } else {
    constexpr int MAGNITUDE_SHIFT = HALF ? 9 : 6;  // T's mantissa bits less one
    constexpr uint32_t RESTORE = HALF ? 0x74007400u : 0x7E807E80u;  // 2^14 or 2^126, twice
    const uint32_t bits = ((codes & 0x00080008u) << 12) | ((codes & 0x00070007u) << MAGNITUDE_SHIFT);
    return __hmul2_rn(pair_of_bits<T>(bits), pair_of_bits<T>(RESTORE));
  }
}

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

// The SCALES (1 or 2) group scales from g on as T. nvfp4's two scales of a 32-code chunk (g
// even) are one 16-bit load and, from compute capability 8.9 on, one conversion by the
// hardware (e4m3 pair to float16 pair: exact for every finite code, as scale_value is; the
// two e4m3 NaN codes, which MLX's quantize never writes, are the only ones it reads otherwise).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kE4M3Pairs = true;  // cvt.rn.f16x2.e4m3x2
#else
constexpr bool kE4M3Pairs = false;
#endif

template <typename T, int FMT, int SCALES>
__device__ __forceinline__ void scale_values(T (&out)[SCALES], const T* scales_t, const uint8_t* scales_u8, int g) {
  if constexpr (FMT == 1 && SCALES == 2 && kE4M3Pairs) {
    const unsigned short two = *reinterpret_cast<const unsigned short*>(scales_u8 + g);
    uint32_t h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    const __half2 h = *reinterpret_cast<const __half2*>(&h2);
    out[0] = from_float<T>(__low2float(h));
    out[1] = from_float<T>(__high2float(h));
  } else {
#pragma unroll
    for (int s = 0; s < SCALES; ++s) out[s] = scale_value<T, FMT>(scales_t, scales_u8, g + s);
  }
}

}  // namespace lockstep_quant
