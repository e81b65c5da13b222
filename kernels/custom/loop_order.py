"""NumPy model of the skinny matmul kernels' loop order (skinny_matmul.cu / .metal).

This is the specification the kernels follow, step by step, so the index math (units, lanes,
tails, quantization groups, nibble positions) can be checked on a CPU:

- one warp (Metal: SIMD group) of 32 lanes computes whole output columns n, for all M rows;
  K is never split across warps, and which warp or block runs a column changes nothing;
- K is cut into units of V consecutive elements (16 bytes of weight: 8 bf16/fp16, 4 fp32,
  32 four-bit codes); unit u is run by lane u % 32; a lane visits its units in increasing u
  and a unit's elements in increasing k; the partial last unit (K % V elements) is unit
  K // V under the same rule;
- each lane keeps acc = fma(x[m, k], w[n, k], acc) in float32, from 0;
- lanes are combined by the butterfly acc += shfl_xor(acc, s) for s = 16, 8, 4, 2, 1;
- quantized weights are dequantized per element as the kernel does: affine
  fma(scale, q, bias), nvfp4 e2m1(q) * e4m3(scale) (exact in float32).

Nothing here depends on M: a row's bits are a function of its own x row, W and K.
"""
import numpy as np

LANES = 32
VECTOR_BYTES = 16  # one weight load per lane per unit
CODES_PER_WORD = 8  # 4-bit codes in a uint32, lowest nibble first
QUANT_UNIT = VECTOR_BYTES * 2  # 4-bit codes per 16-byte unit
MAX_ROWS = 64  # acc registers per lane: rows x columns per warp stay <= 64

# e2m1 code -> value (bit 3 is the sign)
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def unit_elements(itemsize: int) -> int:
    """Elements per unit of a dense weight row (16 bytes)."""
    return VECTOR_BYTES // itemsize


def columns_per_warp(rows: int) -> int:
    """Output columns one warp computes (register budget: rows x columns <= 64, and one
    column per warp for few rows so that decode has enough warps in flight). Changes only
    which warp computes a column, never the order of a column's reduction."""
    if rows <= 4:
        return 1
    return 2 if rows <= 32 else 1


def launch_threads(n: int, cols: int, block: int = 128) -> int:
    """Threads to launch (whole blocks): one warp per `cols` output columns."""
    warps = -(-n // cols)
    return -(-warps * LANES // block) * block


def lane_schedule(k: int, unit: int) -> list:
    """For each lane, the k indices it accumulates, in order."""
    full, tail = divmod(k, unit)
    lanes = [[] for _ in range(LANES)]
    for u in range(full + (1 if tail else 0)):
        lanes[u % LANES].extend(range(u * unit, min(u * unit + unit, k)))
    return lanes


def fp32_fma(a, b, c):
    """float32 fma(a, b, c): the product is exact in float64 (24 + 24 bits); the sum is
    rounded to float64 then float32, which can differ from one rounding only on rare ties."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def butterfly(partials: list) -> np.ndarray:
    """The kernels' lane reduction: xor butterfly over 32 lanes, float32 adds."""
    vals = [p.astype(np.float32) for p in partials]
    for s in (16, 8, 4, 2, 1):
        vals = [vals[lane] + vals[lane ^ s] for lane in range(LANES)]
    return vals[0]


def skinny_matmul(x: np.ndarray, w: np.ndarray, unit: int) -> np.ndarray:
    """float32 result of x (M, K) @ w (N, K).T in the kernels' loop order (x, w as float32:
    bf16/fp16 inputs convert exactly). Round to the output dtype afterwards."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    m, k = x.shape
    partials = []
    for ks in lane_schedule(k, unit):
        acc = np.zeros((m, w.shape[0]), np.float32)
        for kk in ks:
            acc = fp32_fma(x[:, kk, None], w[None, :, kk], acc)
        partials.append(acc)
    return butterfly(partials)


def e4m3(byte: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (bias 7, no infinities) as float32, the way the kernels decode it."""
    b = np.asarray(byte, np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, mant = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, mant * 2.0**-9, (8 + mant) * 2.0 ** (e - 10))
    return (sign * mag).astype(np.float32)


def quant_code(words: np.ndarray, k: int) -> np.ndarray:
    """4-bit code of element k in each row of packed uint32 words (N, K / 8)."""
    return (words[:, k // CODES_PER_WORD].astype(np.int64) >> (4 * (k % CODES_PER_WORD))) & 0xF


def dequantize(words, scales, biases, *, group_size: int, mode: str) -> np.ndarray:
    """(N, K) float32 weights exactly as the kernels dequantize them, element by element."""
    words = np.asarray(words, np.uint32)
    n, k = words.shape[0], words.shape[1] * CODES_PER_WORD
    out = np.empty((n, k), np.float32)
    for kk in range(k):
        q = quant_code(words, kk)
        g = kk // group_size
        if mode == "affine":
            s = np.asarray(scales, np.float32)[:, g]
            b = np.asarray(biases, np.float32)[:, g]
            out[:, kk] = fp32_fma(s, q.astype(np.float32), b)
        elif mode == "nvfp4":
            out[:, kk] = FP4_E2M1[q] * e4m3(np.asarray(scales)[:, g])
        else:
            raise ValueError(f"mode {mode!r} has no kernel")
    return out
