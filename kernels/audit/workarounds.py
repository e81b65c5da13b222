"""Stand-ins for quantized layers whose kernels failed the audit.

They patch a model from outside (module swap), never by forking mlx-lm model files:
- `pad32`: the quantized (input) dim is zero-padded to a multiple of 32 — packed
  words, scales and biases of zero decode to weight 0 in every mode — and the input is
  zero-padded to match, so the kernels only see the shapes they handle; lookups slice
  the padding off again. The known MLX faults all sit on dims that are 16 mod 32.
- `dequantized`: the layer becomes a dense float32 layer built from the audit's
  independent NumPy decode. Always correct, costs memory and speed; logged loudly.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PAD_MULTIPLE = 32


def _pad_last(a: mx.array | None, extra: int) -> mx.array | None:
    if a is None or extra == 0:
        return a
    pad = mx.zeros((*a.shape[:-1], extra), dtype=a.dtype)
    return mx.concatenate([a, pad], axis=-1)


class _Padded(nn.Module):
    """Shared state: padded weight/scales/biases of one quantized layer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.in_dims = layer["weight"].shape[-1] * 32 // layer.bits
        padded = -(-self.in_dims // PAD_MULTIPLE) * PAD_MULTIPLE
        extra = padded - self.in_dims
        self.pad = extra
        self.weight = _pad_last(layer["weight"], extra * layer.bits // 32)
        self.scales = _pad_last(layer["scales"], extra // layer.group_size)
        if layer.get("biases") is not None:
            self.biases = _pad_last(layer["biases"], extra // layer.group_size)
        if "bias" in layer:
            self.bias = layer["bias"]
        self.freeze()

    def _pad_input(self, x: mx.array) -> mx.array:
        if self.pad == 0:
            return x
        return mx.concatenate([x, mx.zeros((*x.shape[:-1], self.pad), dtype=x.dtype)], axis=-1)

    def _matmul(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(self._pad_input(x), self["weight"], scales=self["scales"],
                                   biases=self.get("biases"), transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)


class PaddedQuantizedLinear(_Padded):
    def __call__(self, x):
        y = self._matmul(x)
        return y + self["bias"] if "bias" in self else y


class PaddedQuantizedEmbedding(_Padded):
    def __call__(self, ids):
        biases = self.get("biases")
        dense = mx.dequantize(self["weight"][ids], scales=self["scales"][ids],
                              biases=biases[ids] if biases is not None else None,
                              group_size=self.group_size, bits=self.bits, mode=self.mode)
        return dense[..., : self.in_dims]

    def as_linear(self, x):
        return self._matmul(x)


class PaddedQuantizedSwitchLinear(_Padded):
    def __call__(self, x, indices, sorted_indices=False):
        y = mx.gather_qmm(self._pad_input(x), self["weight"], self["scales"], self.get("biases"),
                          rhs_indices=indices, transpose=True, group_size=self.group_size,
                          bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


def padded(layer: nn.Module, kind: str) -> nn.Module | None:
    """The pad32 stand-in, or None when padding would change nothing."""
    in_dims = layer["weight"].shape[-1] * 32 // layer.bits
    if in_dims % PAD_MULTIPLE == 0 or layer.get("global_scale") is not None:
        return None
    cls = {"linear": PaddedQuantizedLinear, "embedding": PaddedQuantizedEmbedding,
           "switch": PaddedQuantizedSwitchLinear}[kind]
    return cls(layer)


def dequantized(layer: nn.Module, kind: str, dense_weight: np.ndarray) -> nn.Module:
    """A dense float32 layer holding `dense_weight` (the audit's reference decode)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    weight = mx.array(dense_weight.astype(np.float32))
    has_bias = "bias" in layer
    if kind == "embedding":
        dense = nn.Embedding(*weight.shape)
    elif kind == "linear":
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    else:
        dense = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0], bias=has_bias)
    dense.weight = weight
    if has_bias:
        dense.bias = layer["bias"]
    dense.freeze()
    return dense


WORKAROUNDS = ("pad32", "dequantized")


def build(name: str, layer: nn.Module, kind: str, dense_weight: np.ndarray) -> nn.Module | None:
    if name == "pad32":
        return padded(layer, kind)
    if name == "dequantized":
        return dequantized(layer, kind, dense_weight)
    raise ValueError(f"unknown workaround {name!r}")
