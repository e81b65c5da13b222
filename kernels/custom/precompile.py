"""What a startup compiles before the first forward: every custom CUDA kernel instance a
model's layers will launch at the widths it serves, all at once and concurrently
(compiled.py keeps each per machine, so a restart reads them from disk).

    from lockstep.kernels.custom.precompile import linear_shapes, precompile_for
    st = setting.strategy
    precompile_for(linear_shapes(model, dense=st.dense, quantized=st.quantized_form),
                   range(1, setting.call_rows + 1), attention=[(mx.float16, 64)])

Elsewhere than CUDA, or where the precompiled path is off, this does nothing (returns 0)
and the kernels compile on first use as before. Not imported by the package's __init__
(attention.py's import of kernels.invariance would make a cycle).
"""
from __future__ import annotations

from typing import Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import (attention, compiled, gemv_rows, mma_rows, qmv_mma, qmv_mma_parts, qmv_rows, qmv_split, skinny,
               split_attention, split_rows)
from .gemv_order import MAX_ROWS as GEMV_MAX_ROWS
from .loop_order import MAX_ROWS as SKINNY_MAX_ROWS
from .qmv_order import MLX_GEMV_ROWS, weight_bits

# A shape's kind: which kernel its layer's rows run. "gemv_rows": dense rows of 2..64 (one
# row is MLX's own GEMV); "skinny": dense rows of 1..64; "affine" / "nvfp4": 4-bit weights
# through the skinny kernel, 1..64 rows; "qmv_rows": quantized rows of 8..64 in the order of
# MLX's quantized GEMV (the shape carries group, mode and bits); "qmv_split": a large 4-bit
# or middling 4-bit layer's rows of any count in lockstep's own kernels (group, mode and bits
# as qmv_rows), the kernel split_rows.kernel_for picks at each width; "qmv_mma_parts": a sibling
# group's one launch (n: the parts' widths) at the widths split_rows.parts_take gives it.
KINDS = ("gemv_rows", "skinny", "affine", "nvfp4", "qmv_rows", "qmv_split", "qmv_mma_parts")


def instances_for(shapes: Iterable[tuple], widths: Iterable[int], *, attention_shapes=()) -> list:
    """(family, template) of every launch: shapes (n, k, x dtype, kind[, group[, mode, bits]])
    at each width, and the pooled attention's (dtype, head size) pairs. qmv_rows shapes build
    the variant its smoke test proved (none where none is)."""
    widths = sorted(set(widths))
    out = []
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        n, k, dtype, kind, *rest = shape
        group = rest[0] if rest else 0
        if kind not in KINDS:
            raise ValueError(f"shape kind {kind!r} is not one of {KINDS}")
        if kind == "qmv_rows":
            mode, bits = rest[1], rest[2]
            fused = qmv_rows.proven_variant(mode, weight_bits(mode, bits), dtype)
            if fused is not None:
                # calls of 2..MLX_GEMV_ROWS rows are MLX's own: what they would launch is
                # built as the launch of a pass wider than L (from MLX_GEMV_ROWS + 1 rows)
                launched = {max(m, MLX_GEMV_ROWS + 1) for m in widths if 2 <= m <= GEMV_MAX_ROWS}
                out += [i for m in sorted(launched)
                        for i in qmv_rows.instances(m, n, k, mode, bits, group, dtype, fused)]
            continue
        if kind == "qmv_mma_parts":
            mode, bits = rest[1], rest[2]
            if split_rows.parts_kernel_for(n, k, mode, bits, group, dtype) is not None:
                out += [i for m in widths if any(split_rows.parts_take(m, canonical) for canonical in (True, False))
                        for i in qmv_mma_parts.instances(m, n, k, mode, group, dtype)]
            continue
        if kind == "qmv_split":  # split_rows.kernel_for: which kernel each width runs
            mode = rest[1]
            for m in widths:
                for kernel in {split_rows.kernel_for(n, k, mode, dtype, m, canonical) for canonical in (True, False)}:
                    if kernel is qmv_mma:
                        out += qmv_mma.instances(m, n, k, mode, group, dtype)
                    elif kernel is qmv_split and qmv_split.unavailable_reason(mode, dtype) is None:
                        out += qmv_split.instances(m, n, mode, group, dtype)
            continue
        for m in widths:
            if kind == "gemv_rows":
                if 2 <= m <= GEMV_MAX_ROWS:
                    out += gemv_rows.instances(m, n, k, dtype)
            elif 1 <= m <= SKINNY_MAX_ROWS:
                out += skinny.instances("dense" if kind == "skinny" else kind, m, n, k, dtype, group)
    for dtype, dim, *group in attention_shapes:  # group: query heads a KV head has, where known
        if attention.kernel_takes(dtype, dim):
            out += attention.instances(dtype, dim)
        if split_attention.kernel_takes(dtype, dim):  # plain passes' attention
            out += split_attention.instances(dtype, dim, *group)
    return out


def precompile_for(shapes: Iterable[tuple], widths: Iterable[int], *, attention=(),
                   workers: int | None = None) -> int:
    """Compile, or read from this machine's cache, every instance `shapes` launch at `widths`
    (see instances_for), concurrently (`workers`: default one per core). Returns how many
    instances are ready; 0 off CUDA or where the precompiled path cannot run."""
    if skinny.backend() != "cuda":
        return 0
    return compiled.precompile(instances_for(shapes, widths, attention_shapes=attention), workers)


def activation_dtype(model):
    """The type the model computes in: its first float parameter's that is not a quantization scale or bias."""
    for name, value in tree_flatten(model.parameters()):
        if value.dtype in skinny.FLOAT_DTYPES and not name.endswith(("scales", "biases")):
            return value.dtype
    return mx.float32


def linear_shapes(model, *, dense: str, quantized: str = "chunks", dtype=None) -> list[tuple]:
    """(n, k, x dtype, kind, group[, mode, bits]) of the model's linears (embeddings too: a
    tied head runs as one) whose rows the custom kernels take under these forms: dense
    "gemv_rows" / "skinny" / "mma_rows" (its kernel per layer; else no dense shapes),
    quantized "skinny" / "qmv_rows", and under any form large 4-bit layers' "qmv_split" and
    sibling groups' "qmv_mma_parts" (n: the parts' widths). dtype: the activations' type for
    float-format layers (default: the model's first float parameter's)."""
    shapes = {}
    activations = dtype or activation_dtype(model)
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            bits, group, mode = module.bits, module.group_size, getattr(module, "mode", "affine")
            n, k = module.weight.shape[0], module.weight.shape[1] * 32 // weight_bits(mode, bits)
            x_dtype = module.scales.dtype if mode == "affine" else activations
            if split_rows.takes_layer(n, k, mode, bits, group):  # any form
                shapes[(n, k, x_dtype, "qmv_split", group, mode, bits)] = None
            if quantized == "qmv_rows" and qmv_rows.takes(mode, bits, group):
                shapes[(n, k, x_dtype, "qmv_rows", group, mode, bits)] = None
                continue
            kind = skinny.quantized_kind(mode, bits, group) if quantized == "skinny" else None
            if kind is not None:  # 4-bit affine or nvfp4: n, k and x_dtype as above
                shapes[(n, k, x_dtype, kind, group if kind == "affine" else 0)] = None
        elif isinstance(module, (nn.Linear, nn.Embedding)) and dense in ("gemv_rows", "skinny", "mma_rows"):
            n, k = module.weight.shape
            t = module.weight.dtype
            shapes[(n, k, t, mma_rows.form_for(n, k, t, t) if dense == "mma_rows" else dense, 0)] = None
    for layers in split_rows.sibling_groups(model):  # any form: their groups' launches
        ns, k, mode, bits, group = split_rows.group_shape(layers)
        x_dtype = layers[0].scales.dtype if mode == "affine" else activations
        if split_rows.parts_kernel_for(ns, k, mode, bits, group, x_dtype) is not None:
            shapes[(ns, k, x_dtype, "qmv_mma_parts", group, mode, bits)] = None
    return list(shapes)
