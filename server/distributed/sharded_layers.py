"""mlx-lm's tensor-parallel linears (mlx.nn.layers.distributed), made batch invariant.

`model.shard()` replaces each linear by an all-to-sharded (output columns split, no
communication) or a sharded-to-all layer (input split, partial products summed over the
ranks). Their own calls are the native ones; here each gets a subclass (a class swap, same
parameters) that
- computes its local product with the canonical form of the installed batch-invariance
  setting (kernels/invariance/ops.py) for calls of M <= L rows, exactly like the unsharded
  invariant layers (kernels/invariance/layers.py), and
- for a sharded-to-all layer, reduces calls of M <= `ordered_rows` rows with
  `ordered_all_sum` (rank order, independent of M), whatever the strategy: the backend's
  all_sum may add the ranks' parts in an order that depends on the buffer size.
Calls of more rows (long prefill chunks) run the layers' own native path.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from lockstep.kernels.invariance.layers import active_setting
from lockstep.kernels.invariance.ops import dense_rows, quantized_rows, rows_of
from lockstep.server.distributed.collectives import ordered_all_sum


def _setting(x):
    s = active_setting()
    return s if s is not None and rows_of(x) <= s.call_rows else None


def _dense(layer, x):
    s = _setting(x)
    if s is None or s.strategy.dense == "native":
        return x @ layer["weight"].T
    return dense_rows(x, layer["weight"], s.strategy.dense)


def _quantized(layer, x):
    s = _setting(x)
    rows_per_call = 0 if s is None else s.strategy.quantized_rows
    form = "chunks" if s is None else s.strategy.quantized_form
    return quantized_rows(x, layer["weight"], layer["scales"], layer.get("biases"),
                          group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                          rows_per_call=rows_per_call, form=form)


def _reduce(layer, y, x):
    if rows_of(x) <= layer.ordered_rows:
        return ordered_all_sum(y, layer.group)
    return mx.distributed.all_sum(y, group=layer.group)


class InvariantAllToShardedLinear(nn.AllToShardedLinear):
    def __call__(self, x):
        y = _dense(self, x)  # the bias is a separate add for every M (never a fused addmm)
        return y + self["bias"] if "bias" in self else y


class InvariantShardedToAllLinear(nn.ShardedToAllLinear):
    ordered_rows = 0

    def __call__(self, x):
        y = _reduce(self, _dense(self, x), x)
        return y + self["bias"] if "bias" in self else y


class InvariantQuantizedAllToShardedLinear(nn.QuantizedAllToShardedLinear):
    def __call__(self, x):
        y = _quantized(self, x)
        return y + self["bias"] if "bias" in self else y


class InvariantQuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    ordered_rows = 0

    def __call__(self, x):
        y = _reduce(self, _quantized(self, x), x)
        return y + self["bias"] if "bias" in self else y


SWAPS = {
    nn.AllToShardedLinear: InvariantAllToShardedLinear,
    nn.ShardedToAllLinear: InvariantShardedToAllLinear,
    nn.QuantizedAllToShardedLinear: InvariantQuantizedAllToShardedLinear,
    nn.QuantizedShardedToAllLinear: InvariantQuantizedShardedToAllLinear,
}


def make_invariant(model, ordered_rows: int) -> int:
    """Swap every sharded linear of `model` for its invariant subclass; sums of calls with at
    most `ordered_rows` rows are reduced in rank order. Returns how many were swapped."""
    swapped = 0
    for _, m in model.named_modules():
        cls = SWAPS.get(type(m))
        if cls is not None:
            m.__class__ = cls
            swapped += 1
        if isinstance(m, tuple(SWAPS.values())) and hasattr(type(m), "ordered_rows"):
            m.ordered_rows = ordered_rows
    return swapped
