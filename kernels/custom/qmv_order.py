"""NumPy model of the order qmv_rows.cu follows: that of MLX's quantized GEMV on CUDA
(mlx/backend/cuda/quantized/qmm/qmv.cu), the kernel `mx.quantized_matmul` runs on sm80/sm90
for fewer than 8 rows, so the call a plain decode step makes for a quantized linear.

- one warp per output column; K is never split across warps;
- lane l takes EPT consecutive elements at idx = EPT * l + 32 * EPT * t, t = 0, 1, ..; then,
  where K % (32 * EPT) != 0, one more tile at idx = EPT * l + K - K % (32 * EPT) if idx < K;
- EPT (MLX's elems_per_thread) is 16 for 16-bit x with weights of at most 4 bits, else 8;
- a weight is dequantized in x's type T: T(code) * T(scale), plus the bias (affine), each
  step rounded to T, or (FUSED) code * scale + bias rounded once: MLX's Array operators
  leave that choice to the PTX assembler, so the smoke test finds which one its build made;
- weights of at most 4 bits: EPT accumulators of type T, acc[i] = fma(x, w, acc[i]) rounded
  to T once (bf16x2 / f16x2 fma); 8-bit weights: the dequantized T promoted to float32 and
  float32 fma;
- s = 0.0f; s += float(acc[i]) for i = 0 .. EPT - 1; then the xor butterfly over the lanes
  (offsets 16, 8, 4, 2, 1: cooperative_groups::reduce for a float sum), rounded to T.

Nothing depends on M: x's row m is read at x + m * K by every warp alike, so a row's bits
are a function of its own x row, the weight and K. Fixed-point emulation below: a product of
two 16-bit floats is exact in float64 and each sum is rounded once to the target type.
"""
import numpy as np

from .loop_order import FP4_E2M1, LANES, e4m3

# The most rows a call may hold for MLX to run this GEMV per row (8 or more: its tiled kernel).
MLX_GEMV_ROWS = 7
FORMATS = ("affine", "nvfp4", "mxfp4", "mxfp8")
GROUP_SIZES = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}
# (significant bits, smallest normal exponent) of the types the kernel computes in
_TYPES = {"bfloat16": (8, -126), "float16": (11, -14), "float32": (24, -126)}
X_BITS = {"bfloat16": 16, "float16": 16, "float32": 32}


def elems_per_thread(x_bits: int, w_bits: int) -> int:
    """MLX's elems_per_thread: 16 for 16-bit x and at most 4-bit weights, else 8."""
    return 16 if x_bits <= 16 and w_bits <= 4 else 8


def weight_bits(mode: str, bits: int) -> int:
    return {"nvfp4": 4, "mxfp4": 4, "mxfp8": 8}.get(mode, bits)


def round_to(v, dtype: str) -> np.ndarray:
    """v (float64) rounded to nearest-even in `dtype` (subnormals kept; no overflow)."""
    v = np.asarray(v, np.float64)
    p, emin = _TYPES[dtype]
    _, e = np.frexp(v)
    quantum = np.ldexp(1.0, np.maximum(e - 1, emin) - (p - 1))
    return np.rint(v / quantum) * quantum


def lane_tiles(k: int, ept: int) -> list:
    """For each lane, the first index of each tile it takes, in order (MLX's loop)."""
    per_warp = LANES * ept
    lanes = [[lane * ept + t * per_warp for t in range(k // per_warp)] for lane in range(LANES)]
    rest = k % per_warp
    for lane in range(LANES):
        idx = lane * ept + k - rest
        if rest and idx < k:
            lanes[lane].append(idx)
    return lanes


def codes(words: np.ndarray, bits: int) -> np.ndarray:
    """(N, K) codes of packed uint32 words (N, K * bits / 32), lowest bits first."""
    words = np.asarray(words, np.uint32).astype(np.int64)
    per_word = 32 // bits
    shifts = bits * np.arange(per_word)
    return ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def code_values(q: np.ndarray, mode: str) -> np.ndarray:
    """Each code's value (exact in bf16 and fp16)."""
    if mode == "affine":
        return q.astype(np.float64)
    if mode == "mxfp8":
        return e4m3(q).astype(np.float64)
    return FP4_E2M1[q].astype(np.float64)


def scale_values(scales: np.ndarray, mode: str, dtype: str) -> np.ndarray:
    """Each group's scale as T: affine scales are T already; e4m3 converts exactly; ue8m0
    is 2^(e - 127), rounded to T as a conversion through float32 does."""
    if mode == "affine":
        return np.asarray(scales, np.float64)
    if mode == "nvfp4":
        return e4m3(scales).astype(np.float64)
    return round_to(np.ldexp(1.0, np.asarray(scales, np.int64) - 127), dtype)


def dequantize(words, scales, biases, *, mode: str, bits: int, group_size: int, dtype: str,
               fused: bool = False) -> np.ndarray:
    """(N, K) weights in x's type T (as float64) the way the GEMV dequantizes them."""
    q = code_values(codes(words, weight_bits(mode, bits)), mode)
    s = np.repeat(scale_values(scales, mode, dtype), group_size, axis=1)
    if mode != "affine":
        return round_to(q * s, dtype)  # exact unless a ue8m0 scale leaves T's range
    b = np.repeat(np.asarray(biases, np.float64), group_size, axis=1)
    return round_to(q * s + b, dtype) if fused else round_to(round_to(q * s, dtype) + b, dtype)


def qmv_rows(x: np.ndarray, w: np.ndarray, *, w_bits: int, dtype: str) -> np.ndarray:
    """Each row of x (M, K) @ w (N, K).T, w already dequantized in T (dequantize), in the
    order of MLX's quantized GEMV, as float64 values of T. dtype: x's type."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    m, k = x.shape
    n = w.shape[0]
    ept = elems_per_thread(X_BITS[dtype], w_bits)
    if k % ept:
        raise ValueError(f"K = {k} is not a multiple of {ept} (MLX's GEMV reads past the row)")
    acc_type = "float32" if w_bits >= 8 or dtype == "float32" else dtype
    acc = np.zeros((LANES, m, n, ept))
    for lane, starts in enumerate(lane_tiles(k, ept)):
        for idx in starts:
            xs = x[:, None, idx : idx + ept]
            ws = w[None, :, idx : idx + ept]
            acc[lane] = round_to(xs * ws + acc[lane], acc_type)
    sums = np.zeros((LANES, m, n))
    for i in range(ept):
        sums = round_to(sums + acc[..., i], "float32")
    for offset in (16, 8, 4, 2, 1):
        sums = round_to(sums + sums[np.arange(LANES) ^ offset], "float32")
    return round_to(sums[0], dtype)
