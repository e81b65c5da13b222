"""Index model of the tensor-core skinny matmul (skinny_mma.cu): which elements of K each
warp, chunk and MMA takes, in which order, so the index math (chunks, lane groups, operand
slots, tails, quantization groups) can be checked on a CPU.

- A block of WARPS warps computes 8 * NT output columns (NT: a function of N) for all rows.
  K is cut into chunks of 4 * RUN elements (RUN = 8 for 16-bit weights: one 16-byte load
  per lane; 16 for 4-bit: one 8-byte load, within one quantization group);
  chunk c is run by warp c % WARPS, in increasing c; the last chunk may be partial and is
  zero-padded.
- In chunk c, lane group q (lane % 4) holds elements c * CHUNK + q * RUN .. + RUN - 1. MMA j
  of the chunk (j < RUN / 4) puts elements q * RUN + 4j + (0, 1) in its k slots 2q, 2q + 1
  and q * RUN + 4j + (2, 3) in slots 2q + 8, 2q + 9, for A (x rows) and B (W columns) alike.
- Each MMA adds a 16-term dot product to the warp's float32 accumulator; the warps' sums are
  added in warp order.

The tensor core's own rounding inside one MMA is the hardware's, not modelled bit for bit:
`skinny_mma` sums each MMA's 16 products exactly and rounds once, so it matches the kernel
closely, not bitwise. Nothing here depends on the number of rows.
"""
import numpy as np

WARPS = 4
LANE_GROUPS = 4  # lanes sharing one output column (lane % 4)
SLOTS = 16  # k of one m16n8k16 MMA


def run_elements(weight_bits: int) -> int:
    """Elements of K one lane loads per chunk and column: 16 bytes of a 16-bit weight, 8 bytes
    of 4-bit codes."""
    return 8 if weight_bits == 16 else 16


def chunk_elements(weight_bits: int) -> int:
    return LANE_GROUPS * run_elements(weight_bits)


def warp_chunks(k: int, weight_bits: int) -> list:
    """For each warp, the chunks it runs, in order (the last one may be partial)."""
    chunks = -(-k // chunk_elements(weight_bits))
    return [list(range(w, chunks, WARPS)) for w in range(WARPS)]


def mma_elements(chunk: int, j: int, weight_bits: int) -> np.ndarray:
    """The K index in each of MMA j's 16 slots (slot order 0..15) in this chunk."""
    run = run_elements(weight_bits)
    slots = np.arange(SLOTS)
    q, t, high = (slots % 8) // 2, slots % 2, slots // 8
    return chunk * chunk_elements(weight_bits) + q * run + 4 * j + 2 * high + t


def schedule(k: int, weight_bits: int) -> list:
    """For each warp, its MMAs in order, each as the 16 K indices of its slots (indices >= k
    are the zero padding of the last chunk)."""
    mmas_per_chunk = run_elements(weight_bits) // 4
    return [[mma_elements(c, j, weight_bits) for c in chunks for j in range(mmas_per_chunk)]
            for chunks in warp_chunks(k, weight_bits)]


def skinny_mma(x: np.ndarray, w: np.ndarray, weight_bits: int) -> np.ndarray:
    """float32 x (M, K) @ w (N, K).T in the kernel's order, each MMA's 16 products summed
    exactly and rounded once (w: the weights as the kernel feeds them, dequantized)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    k = x.shape[1]
    xp = np.concatenate([x, np.zeros((x.shape[0], 4 * chunk_elements(weight_bits)))], axis=1)
    wp = np.concatenate([w, np.zeros((w.shape[0], 4 * chunk_elements(weight_bits)))], axis=1)
    total = None
    for mmas in schedule(k, weight_bits):
        acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
        for ks in mmas:
            acc = (acc.astype(np.float64) + xp[:, ks] @ wp[:, ks].T).astype(np.float32)
        total = acc if total is None else (total + acc).astype(np.float32)
    return total
