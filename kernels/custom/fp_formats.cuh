// Decoding of the 4- and 8-bit float formats the CUDA kernels dequantize (nvfp4 codes and
// scales). kernels/custom/skinny.py puts this file before skinny_matmul.cu and skinny_mma.cu.

namespace lockstep_fp {

// FP8 E4M3 (bias 7, no infinities) to float, exactly.
__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  const int e = (b >> 3) & 0xF, mant = b & 0x7;
  const float mag = e == 0 ? (float)mant * 0x1p-9f
                           : (float)(8 + mant) * __int_as_float((e - 10 + 127) << 23);
  return (b & 0x80) ? -mag : mag;
}

// FP4 E2M1 code (low 4 bits of q) to float, built bit by bit (a table would sit in local
// memory): sign bit 3, exponent bits 2-1 (bias 1; 0 = subnormal 0 or 0.5), mantissa bit 0.
__device__ __forceinline__ float e2m1_to_float(uint32_t q) {
  const uint32_t e = (q >> 1) & 3u, m = q & 1u;
  const uint32_t mag = e == 0 ? (m ? 0x3F000000u : 0u) : ((e + 126u) << 23) | (m << 22);
  return __uint_as_float(mag | ((q & 8u) << 28));
}

}  // namespace lockstep_fp
