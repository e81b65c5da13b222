"""The float type a served GGUF import computes in, by backend: the one place that decides.

A GGUF import keeps its norms, its quantization scales and biases and the tensors it leaves
dense in float32 (models/gguf_import.py), for MLX's CPU backend, where float32 runs fastest.
On a GPU, MLX's models run 16-bit activations, and lockstep's quantized kernels (qmv_rows,
qmv_mma, qmv_split) and mma_rows' tensor cores take 16-bit activations only, so there those
float32 parameters become 16-bit, and the activations and the KV cache with them: float16,
where Q4_0, Q4_1 and Q8_0 blocks store their scales (and Q4_1 its minimums), so a native 4-bit
import's scales and biases stay exact; bfloat16 for a model with nvfp4, mxfp4 or mxfp8 layers
(`--quantize`), whose values MLX dequantizes to bfloat16 (a quantized embedding's lookup among
them): with float16 norms, the first norm would mix the two and promote every activation after
it to float32. `--weights float32` keeps float32.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

GPU_DTYPE = mx.float16
# MLX's dequantization of these modes gives bfloat16 (mx.dequantize's default for them)
FP_MODES = ("nvfp4", "mxfp4", "mxfp8")
FP_MODES_DTYPE = mx.bfloat16


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def served_dtype(weights: str, gguf: bool, gpu: bool, fp_modes: bool = False):
    """The dtype a served model's float32 parameters are cast to, None where they are kept:
    a GGUF import's on a GPU (with --quantize too, whose source is the float32 import whatever
    `weights` says), unless `--weights float32` asked for them; bfloat16 where the model has
    layers of FP_MODES (fp_modes), else float16."""
    if not (gguf and gpu) or weights == "float32":
        return None
    return FP_MODES_DTYPE if fp_modes else GPU_DTYPE


def has_fp_modes(model: nn.Module) -> bool:
    """Whether any quantized layer of `model` (linear or embedding) is of FP_MODES."""
    return any(getattr(layer, "mode", None) in FP_MODES and "scales" in layer for _, layer in model.named_modules())


def apply(model: nn.Module, spec: str, weights: str):
    """`served_dtype`'s cast, done on `model` loaded from `spec` with `--weights weights` (after
    any quantization): the dtype its float32 parameters now have, None where none changed."""
    from lockstep.models.resolve import gguf_source

    dtype = served_dtype(weights, gguf_source(spec) is not None, on_gpu(), has_fp_modes(model))
    return dtype if dtype is not None and cast_float32(model, dtype) else None


def float32_note(model: nn.Module) -> str | None:
    """On a GPU, what a quantized model that still computes in float32 gives up: a float32
    model directory, `--weights float32`, or a directory whose nvfp4 / mxfp4 / mxfp8 layers
    (bfloat16 when dequantized) sit beside float16 parameters; None elsewhere."""
    if not on_gpu():
        return None
    params = tree_flatten(model.parameters())
    quantized = any(name.endswith(".scales") for name, _ in params)
    dtypes = {a.dtype for _, a in params}
    cost = ("lockstep's quantized kernels take 16-bit activations, so its calls run MLX's own (deterministic "
            "calls wider than 7 rows in several calls)")
    if quantized and mx.float32 in dtypes:
        return f"this quantized model computes in float32 on a GPU: {cost}; a float16 or bfloat16 copy serves faster"
    if mx.float16 in dtypes and has_fp_modes(model):
        return (f"this model computes in float32 after its first float16 layer: MLX dequantizes its "
                f"{'/'.join(FP_MODES)} layers to bfloat16, and bfloat16 beside float16 gives float32; {cost}; "
                "a copy whose float16 parameters are bfloat16 serves faster")
    return None


def cast_float32(model: nn.Module, dtype) -> int:
    """Cast `model`'s float32 parameters to `dtype`; how many were."""
    cast = [(name, a.astype(dtype)) for name, a in tree_flatten(model.parameters()) if a.dtype == mx.float32]
    if cast:
        model.load_weights(cast, strict=False)
    return len(cast)
