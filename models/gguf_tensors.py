"""GGUF tensor data → MLX-ready numpy arrays.

Two paths:
- native: Q4_1 → MLX affine 4-bit, group 32; Q8_0 → MLX affine 8-bit, group 32. Both are
  exact re-encodings (same integers, same scale, bias), no requantization.
- dequantized: any type gguf can dequantize → float32 / float16.

Scales and biases stay float32: on the CPU backend fp16 scales make quantized matmul
much slower and less accurate, and fp16 → fp32 is exact so nothing is lost.
"""
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants

GROUP_SIZE = 32  # Q4_1 and Q8_0 both use 32-element blocks along the input dim

# gguf type → MLX affine bit width, for the types kept quantized as-is.
NATIVE_BITS = {QT.Q4_1: 4, QT.Q8_0: 8}


def _pack_uint32(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints (…, n) into uint32 the way MLX does: element i at bits*(i % per)."""
    per = 32 // bits
    q = q.astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def q4_1_to_affine(raw: np.ndarray, cols: int) -> dict[str, np.ndarray]:
    """Q4_1 blocks (rows, bytes) → MLX affine 4-bit {weight, scales, biases}.

    A Q4_1 block is f16 d, f16 m, 16 bytes; element j is the low nibble of byte j and
    element j+16 the high nibble. Value = d*q + m, which is MLX's scale*q + bias.
    """
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP_SIZE, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return {"weight": _pack_uint32(q, 4), "scales": d, "biases": m}


def q8_0_to_affine(raw: np.ndarray, cols: int) -> dict[str, np.ndarray]:
    """Q8_0 blocks (rows, bytes) → MLX affine 8-bit {weight, scales, biases}.

    A Q8_0 block is f16 d and 32 int8; value = d*qi. MLX's unsigned form is
    q = qi + 128, scale = d, bias = -128*d (all exact in float32).
    """
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP_SIZE, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qi = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
    q = (qi + 128).astype(np.uint8).reshape(rows, cols)
    return {"weight": _pack_uint32(q, 8), "scales": d, "biases": d * np.float32(-128)}


def native_affine(raw: np.ndarray, qtype: QT, cols: int) -> dict[str, np.ndarray] | None:
    """Exact MLX affine form of a quantized tensor, or None if the type has none."""
    if qtype == QT.Q4_1:
        return q4_1_to_affine(raw, cols)
    if qtype == QT.Q8_0:
        return q8_0_to_affine(raw, cols)
    return None


def dequantized(raw: np.ndarray, qtype: QT, dtype=np.float32) -> np.ndarray:
    """Tensor as float (rows, cols) via gguf's own reference dequantization."""
    if qtype in (QT.F32, QT.F16):
        return np.asarray(raw).astype(dtype)
    return quants.dequantize(raw, qtype).astype(dtype)


def unpermute_rope_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`).

    The converter reorders each head's rows from HF's half-split RoPE layout to
    interleaved pairs: reshape(n_head, 2, d/2, …).swapaxes(1, 2). This is the inverse.
    It moves whole rows, so it applies unchanged to packed weights, scales and biases.
    """
    rows = a.shape[0]
    return (
        a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:])
        .swapaxes(1, 2)
        .reshape(a.shape)
    )
