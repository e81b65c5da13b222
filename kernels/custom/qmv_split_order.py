"""NumPy model of the order qmv_split.cu follows (lockstep's own, not MLX's): a few rows of x
times a 4-bit quantized weight, K split across a block of 128 threads.

- K is cut into chunks of 32 codes; thread t takes chunks t, t + 128, t + 256, .., in order;
- a weight is dequantized in x's type T (qmv_order.dequantize: code * scale, affine + bias,
  each step rounded to T);
- within a chunk, pair j (elements 2j, 2j + 1) is fma'd into T pair A (j = 0..7) or B
  (j = 8..15), one rounding to T each: A.x sums the chunk's elements 0, 2, .., 14, A.y
  1, 3, .., 15, B.x 16, 18, .., 30, B.y 17, 19, .., 31, each from 0;
- the thread's float32 sum takes A.x, A.y, B.x, B.y in that order, chunk after chunk;
- each warp's lanes are summed by the xor butterfly (offsets 16, 8, 4, 2, 1), then the four
  warps' sums in warp order; the result is rounded to T.

Nothing depends on M: a row's bits are a function of its own x row, the weight and K.
"""
import numpy as np

from .loop_order import LANES
from .qmv_order import round_to

THREADS = 128
CHUNK = 32


def thread_chunks(k: int) -> list:
    """For each thread, the first index of each chunk it takes, in order."""
    if k % CHUNK:
        raise ValueError(f"K = {k} is not a multiple of {CHUNK}")
    chunks = k // CHUNK
    return [[CHUNK * c for c in range(t, chunks, THREADS)] for t in range(THREADS)]


def qmv_split(x: np.ndarray, w: np.ndarray, *, dtype: str) -> np.ndarray:
    """Each row of x (M, K) @ w (N, K).T, w already dequantized in T, in qmv_split's order,
    as float64 values of T. dtype: x's type (bfloat16 or float16)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    m, k = x.shape
    n = w.shape[0]
    sums = np.zeros((THREADS, m, n))
    for t, starts in enumerate(thread_chunks(k)):
        for start in starts:
            halves = []
            for first in (start, start + 16):  # A, then B
                pair = np.zeros((m, n, 2))
                for j in range(8):
                    i = first + 2 * j
                    products = x[:, None, i : i + 2] * w[None, :, i : i + 2]  # exact in float64
                    pair = round_to(products + pair, dtype)
                halves += [pair[..., 0], pair[..., 1]]
            for part in halves:
                sums[t] = round_to(sums[t] + part, "float32")
    warps = sums.reshape(THREADS // LANES, LANES, m, n)
    for offset in (16, 8, 4, 2, 1):
        warps = round_to(warps + warps[:, np.arange(LANES) ^ offset], "float32")
    total = warps[0, 0]
    for v in range(1, THREADS // LANES):
        total = round_to(total + warps[v, 0], "float32")
    return round_to(total, dtype)
