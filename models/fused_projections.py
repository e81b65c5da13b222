"""One matmul for the projections that read the same input: q/k/v of an attention block and
gate/up of an MLP (`serve --fuse-projections`).

A decode step of a large model is bound by how many ops MLX dispatches (docs/BENCHMARKS.md),
and q_proj, k_proj and v_proj each run a matmul of the same x. Here each such group's weights
are concatenated into one layer (`fused_qkv`, `fused_gate_up`; the separate layers are dropped,
so no weight is held twice) and the parent's q_proj, k_proj, v_proj become parts of that
layer's output: the first one called computes it for x, the others slice the same result.
mlx-lm's model files are unchanged: its attention still calls self.q_proj(x), self.k_proj(x)
and self.v_proj(x) in turn.

The fused layers give the separate layers' bits with MLX's quantized kernels and, dense, on
the CPU's reference BLAS; OpenBLAS's float32 kernels block by N, so there they differ within
rounding (tests/test_fused_projections.py). MLX's CUDA GEMV computes each output column in
an order fixed by K. Either way the deployment's audit and proofs run on the fused layers like
on any other, so the guarantee holds for the fused model as served.
Only groups whose layers agree (all dense of one dtype or all quantized alike, biases on all
or none, one input width) are fused.
"""
from __future__ import annotations

import copy
import threading

import mlx.core as mx
import mlx.nn as nn

# (parts, the fused layer's name)
GROUPS = ((("q_proj", "k_proj", "v_proj"), "fused_qkv"), (("gate_proj", "up_proj"), "fused_gate_up"))


class FusedGroup:
    """The parts of one fused layer of `parent`: part i is columns splits[i]:splits[i + 1]."""

    def __init__(self, parent: nn.Module, name: str, widths: list[int]):
        self.parent = parent
        self.name = name
        self.splits = [0]
        for w in widths:
            self.splits.append(self.splits[-1] + w)
        self._local = threading.local()

    def part(self, x: mx.array, index: int) -> mx.array:
        """Part `index` of the fused layer's output for x: computed once for every part that
        asks with the same x (the same array object), then dropped."""
        entry = getattr(self._local, "entry", None)
        if entry is None or entry[0] is not x or index not in entry[2]:
            entry = (x, self.parent[self.name](x), set(range(len(self.splits) - 1)))
            self._local.entry = entry
        entry[2].discard(index)
        if not entry[2]:
            self._local.entry = None
        return entry[1][..., self.splits[index]:self.splits[index + 1]]


class ProjectionPart:
    """Stands where one projection layer was (not a Module: it holds no weights)."""

    def __init__(self, group: FusedGroup, index: int):
        self.group = group
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self.group.part(x, self.index)


def _signature(layer) -> tuple | None:
    """What layers must share to be fused; None: a layer this cannot fuse."""
    has_bias = "bias" in layer
    if isinstance(layer, nn.QuantizedLinear):
        return ("quantized", layer.group_size, layer.bits, getattr(layer, "mode", "affine"),
                layer.weight.shape[1], layer.scales.dtype, "biases" in layer, has_bias)
    if isinstance(layer, nn.Linear):
        return ("dense", layer.weight.shape[1], layer.weight.dtype, has_bias)
    return None


def _fused_layer(layers: list) -> nn.Module:
    fused = copy.copy(layers[0])  # the class and its settings (group size, bits, mode)
    for key in ("weight", "scales", "biases", "bias"):
        if key in layers[0]:
            fused[key] = mx.concatenate([layer[key] for layer in layers], axis=0)
    return fused


def fuse_projections(model: nn.Module) -> list[str]:
    """Fuse every q/k/v and gate/up group of `model` in place; the fused layers' paths."""
    fused = []
    for path, module in list(model.named_modules()):
        for parts, name in GROUPS:
            layers = [module.get(p) if isinstance(module, dict) else None for p in parts]
            if any(layer is None for layer in layers):
                continue
            signatures = {_signature(layer) for layer in layers}
            if len(signatures) != 1 or None in signatures:
                continue
            module[name] = _fused_layer(layers)
            group = FusedGroup(module, name, [layer.weight.shape[0] for layer in layers])
            for i, part in enumerate(parts):
                setattr(module, part, ProjectionPart(group, i))  # drops the layer (Module.__setattr__)
            fused.append(f"{path}.{name}" if path else name)
    mx.eval(model.parameters())
    return fused
