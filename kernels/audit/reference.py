"""Decode quantized MLX weights to float32 in NumPy: the audit's independent reference.

The audit must not judge MLX's kernels with MLX's own `dequantize` (a faulty kernel
would then agree with itself), so the common formats are decoded here from the bit
layout: values packed little-end-first in uint32 words; affine w = q*scale + bias;
mxfp4/nvfp4 values are E2M1, mxfp8 values E4M3; mx* scales are E8M0 (2^(s-127)),
nvfp4 scales E4M3. Affine at 2/3/5/6 bits (packed across word boundaries) falls back
to `mx.dequantize` on the CPU stream, which the audit's own probes still check.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
_FP4 = np.concatenate([_E2M1, -_E2M1])  # by the whole 4-bit code: sign bit 8


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    mant = codes & 0x7
    normal = (1.0 + mant / 8.0) * np.exp2(exp - 7.0)
    subnormal = (mant / 8.0) * np.exp2(-6.0)
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan  # E4M3FN has NaN, no infinities
    return values.astype(np.float32)


_E4M3 = _e4m3_table()


def _unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """uint32 (..., W) → codes (..., W * 32/bits), lowest bits first."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def _fp4(codes: np.ndarray) -> np.ndarray:
    return _FP4[codes]


def _per_group(scales: np.ndarray, group_size: int) -> np.ndarray:
    return np.repeat(scales, group_size, axis=-1)


def reference_dequantize(weight: mx.array, scales: mx.array, biases: mx.array | None,
                         mode: str, bits: int, group_size: int) -> np.ndarray:
    """Float32 NumPy copy of the dense weight a quantized layer stands for."""
    if mode == "affine" and bits not in (2, 4, 8):
        dense = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits,
                              mode=mode, dtype=mx.float32, stream=mx.cpu)
        return np.array(dense)
    codes = _unpack(np.array(weight), bits)
    s = np.array(scales.astype(mx.float32) if scales.dtype != mx.uint8 else scales)
    if mode == "affine":
        b = np.array(biases.astype(mx.float32))
        return codes.astype(np.float32) * _per_group(s, group_size) + _per_group(b, group_size)
    if mode == "mxfp4":
        values, scale = _fp4(codes), np.exp2(s.astype(np.float32) - 127.0)
    elif mode == "mxfp8":
        values, scale = _E4M3[codes], np.exp2(s.astype(np.float32) - 127.0)
    elif mode == "nvfp4":
        values, scale = _fp4(codes), _E4M3[s]
    else:
        raise ValueError(f"no reference decoder for quantization mode {mode!r}")
    return (values * _per_group(scale, group_size)).astype(np.float32)
