"""Index model of qmv_mma.cu (lockstep's own order, on tensor cores): rows of x times a 4-bit
quantized weight, K split across a block's warps.

- K is cut into chunks of 128 codes; chunk c is run by warp c % WARPS, in increasing c;
- in a chunk, lane group q (lane % 4) holds elements q * 32 .. q * 32 + 31; MMA j (0..7) puts
  elements q * 32 + 4j + (0, 1) in its k slots 2q, 2q + 1 and q * 32 + 4j + (2, 3) in slots
  2q + 8, 2q + 9, for x and the weight alike, and adds that 16-term dot product to the warp's
  float32 accumulator;
- a weight is dequantized in x's type T (qmv_order.dequantize: code * scale, affine + bias,
  each step rounded to T), a code's value placed bit by bit (quant_values.cuh's
  codes_as_pair, modelled by code_pair below: exact, so it changes no value);
- the warps' sums are added in warp order and rounded to T.

The tensor core's own rounding inside one MMA is the hardware's, not modelled bit for bit:
`qmv_mma` sums each MMA's 16 products exactly and rounds once to float32, so it matches the
kernel closely (its smoke test bounds the gap), not bitwise. Nothing here depends on M.
"""
import numpy as np

from .qmv_order import round_to

CHUNK = 128
LANE_GROUPS = 4
RUN = CHUNK // LANE_GROUPS  # a lane group's elements of a chunk: one 16-byte load of codes
MMAS = RUN // 4  # MMAs a chunk
SLOTS = 16


def warp_chunks(k: int, warps: int) -> list:
    """For each warp, the chunks it runs, in order."""
    if k % CHUNK:
        raise ValueError(f"K = {k} is not a multiple of {CHUNK}")
    return [list(range(w, k // CHUNK, warps)) for w in range(warps)]


def mma_elements(chunk: int, j: int) -> np.ndarray:
    """The K index in each of MMA j's 16 slots (slot order 0..15) in this chunk."""
    slots = np.arange(SLOTS)
    q, t, high = (slots % 8) // 2, slots % 2, slots // 8
    return chunk * CHUNK + q * RUN + 4 * j + 2 * high + t


def schedule(k: int, warps: int) -> list:
    """For each warp, its MMAs in order, each as the 16 K indices of its slots."""
    return [[mma_elements(c, j) for c in chunks for j in range(MMAS)] for chunks in warp_chunks(k, warps)]


def qmv_mma(x: np.ndarray, w: np.ndarray, *, dtype: str, warps: int) -> np.ndarray:
    """Each row of x (M, K) @ w (N, K).T, w already dequantized in T, in qmv_mma's order (each
    MMA's 16 products summed exactly, rounded once to float32), as float64 values of T."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    m, k = x.shape
    n = w.shape[0]
    total = None
    for mmas in schedule(k, warps):
        acc = np.zeros((m, n))
        for idx in mmas:
            acc = round_to(acc + x[:, idx] @ w[:, idx].T, "float32")
        total = acc if total is None else round_to(total + acc, "float32")
    return round_to(total, dtype)


# quant_values.cuh's codes_as_pair: per 16-bit type, the constants its bit placement uses (as
# 16-bit halves): affine's base (a power of 2 whose last mantissa bit is worth 1) and e2m1's
# magnitude shift and restoring power of 2.
CODE_BITS = {"float16": dict(base=0x6400, shift=9, restore=0x7400),
             "bfloat16": dict(base=0x4300, shift=6, restore=0x7E80)}


def bits_value(bits, dtype: str) -> np.ndarray:
    """16-bit patterns of float16 or bfloat16 as float64 values (subnormals exact)."""
    bits = np.asarray(bits, np.uint32)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def code_pair(byte, mode: str, dtype: str) -> np.ndarray:
    """The values codes_as_pair gives a byte's two codes (low nibble first), step by step: affine
    (base | q) - base; e2m1 the sign to bit 15, the magnitude's three bits shifted to the
    bottom of the exponent, times the restoring power of 2. Each step exact in T."""
    byte = np.asarray(byte, np.uint32)
    c = CODE_BITS[dtype]
    codes = np.stack([byte & 0xF, byte >> 4], axis=-1)
    if mode == "affine":
        return bits_value(codes | c["base"], dtype) - bits_value(c["base"], dtype)
    placed = ((codes & 8) << 12) | ((codes & 7) << c["shift"])
    return bits_value(placed, dtype) * bits_value(c["restore"], dtype)
