"""Sibling 4-bit layers (an attention block's q, k and v; an MLP's gate and up) in one launch.

mlx-lm's model files call the siblings in turn with the same x. The first one called runs
the group's launch (custom/qmv_mma_parts.py, chosen by custom/split_rows.py) and gets its
own part; the others, called next with the same x (the same array object), take theirs from
that launch. The model files stay as they are, and no weight is held twice. A part's bits are
its layer's own qmv_mma call's at every width, so canonical and plain calls may both use it;
custom/split_rows.py decides which groups and calls do.
"""
from __future__ import annotations

import math
import threading

import mlx.core as mx

from .. import custom


class SiblingRows:
    """The launch shared by sibling layers, one per (x shape, x dtype); its parts handed out
    once each per x."""

    def __init__(self, layers: tuple, ns: tuple, k: int, mode: str, bits: int, group_size: int):
        self.layers = layers
        self.ns, self.k, self.mode, self.bits, self.group_size = ns, k, mode, bits, group_size
        self.launches = {}
        self._local = threading.local()

    @classmethod
    def for_group(cls, layers: tuple):
        """The group's SiblingRows, or None where no launch is for it (format, sizes, GPU)."""
        ns, k, mode, bits, group = custom.split_rows.group_shape(layers)
        scales_dtype = layers[0].scales.dtype
        dtypes = (scales_dtype,) if mode == "affine" else (mx.float16, mx.bfloat16)
        if all(custom.split_rows.parts_kernel_for(ns, k, mode, bits, group, d) is None for d in dtypes):
            return None
        return cls(tuple(layers), ns, k, mode, bits, group)

    def _launch(self, x: mx.array):
        key = (x.shape, x.dtype)
        launch = self.launches.get(key, False)
        if launch is False:
            kernel = custom.split_rows.parts_kernel_for(self.ns, self.k, self.mode, self.bits, self.group_size,
                                                        x.dtype)
            first = self.layers[0]
            biases = first.get("biases")
            launch = self.launches[key] = None if kernel is None else kernel.launch_for(
                x.shape[:-1], self.ns, self.k, self.mode, self.bits, self.group_size, x.dtype, first.weight.dtype,
                first.weight.shape[1], first.scales.dtype, None if biases is None else biases.dtype)
        return launch

    def __call__(self, layer, x: mx.array, canonical: bool):
        """`layer`'s rows of x (without its bias) from the group's launch, or None where the
        launch does not take the call (split_rows.parts_take; the layer's own path then runs
        it)."""
        if not custom.split_rows.parts_take(math.prod(x.shape[:-1]), canonical):
            return None
        index = next(i for i, part in enumerate(self.layers) if part is layer)
        entry = getattr(self._local, "entry", None)
        if entry is not None and entry[0] is x and entry[1][index] is not None:
            y, entry[1][index] = entry[1][index], None
            if all(part is None for part in entry[1]):
                self._local.entry = None
            return y
        launch = self._launch(x)
        if launch is None:
            return None
        arrays = []
        for part in self.layers:
            arrays += [part["weight"], part["scales"]] + ([part["biases"]] if self.mode == "affine" else [])
        outputs = list(launch(x, *arrays))
        y, outputs[index] = outputs[index], None
        self._local.entry = (x, outputs)
        return y

