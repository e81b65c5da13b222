"""One row of a large 4-bit quantized layer through `qmv_rows` (kernels/custom/qmv_rows.py)
instead of MLX's own quantized GEMV: the same order, so the same bits (its smoke test compares
one-row launches with MLX's call bit for bit), and faster for gate, up, down and the head of an
8B model (docs/BENCHMARKS.md, session 15). Every one-row call of such a layer takes it, plain
and deterministic passes alike; wider calls are the layer's own.

    swapped = use_one_row_kernels(model)   # 0 off CUDA, or where the kernel is not proven
    remove_one_row_kernels(model)

The batch-invariance forms (kernels/invariance/layers.py) keep it: a swapped layer becomes
their `InvariantOneRowQuantizedLinear`, and goes back to `OneRowQuantizedLinear`.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import qmv_rows
from .qmv_order import weight_bits
from .skinny import backend

_quantized_linear_call = nn.QuantizedLinear.__call__


def one_row_call(layer, x: mx.array) -> mx.array:
    """The layer on x of one row (x.size == K), through the kernel."""
    y = qmv_rows.one_row_matmul(x.reshape(1, -1), layer["weight"], layer["scales"], layer.get("biases"),
                                group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                                fused=layer._one_row_fused, columns=layer._one_row_columns)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y + layer["bias"] if "bias" in layer else y


class OneRowQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        if x.size == x.shape[-1] and x.dtype in qmv_rows.DTYPES:
            return one_row_call(self, x)
        return _quantized_linear_call(self, x)


def _plan(layer: nn.QuantizedLinear, dtype) -> tuple[int, int] | None:
    """(fused variant, columns a warp) where one row of `layer` takes the kernel, else None."""
    n, packed = layer["weight"].shape
    k = packed * 32 // weight_bits(layer.mode, layer.bits)
    columns = qmv_rows.one_row_columns(layer.mode, layer.bits, n, k)
    if columns is None or not qmv_rows.takes(layer.mode, layer.bits, layer.group_size):
        return None
    fused = qmv_rows.proven_variant(layer.mode, weight_bits(layer.mode, layer.bits), dtype)
    return None if fused is None else (fused, columns)


def use_one_row_kernels(model) -> int:
    """Swap every `nn.QuantizedLinear` of `model` whose one row the kernel runs faster (and
    whose kernel is proven on this GPU) for `OneRowQuantizedLinear`; returns how many."""
    if backend() != "cuda":
        return 0
    dtype = next((p.dtype for _, p in _float_parameters(model)), None)
    if dtype not in qmv_rows.DTYPES:
        return 0
    swapped = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear:
            plan = _plan(m, dtype)
            if plan is not None:
                m._one_row_fused, m._one_row_columns = plan
                m.__class__ = OneRowQuantizedLinear
                swapped += 1
    return swapped


def remove_one_row_kernels(model) -> None:
    for _, m in model.named_modules():
        if type(m) is OneRowQuantizedLinear:
            m.__class__ = nn.QuantizedLinear


def _float_parameters(model):
    """The model's floating-point parameters (the activations' dtype is theirs)."""
    from mlx.utils import tree_flatten

    return ((k, v) for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating))
