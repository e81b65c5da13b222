"""Plain ragged passes over the KV pool, traced once per row count and replayed (mx.compile).

    passes = CompiledPasses(model, pool)
    logits = passes.logits([(cache_a, [t0]), (cache_b, [t1, d1])])   # as ragged_logits gives them

A pass built op by op costs the host one Python call chain per op (mlx-lm's model code,
lockstep's layer wrappers, MLX's bindings) before the device gets anything. Over the pool a
pass's graph depends only on its row count: where each row's KV goes, the keys it sees and
its position are arrays (slots, key base and count, positions), and the pool's keys and
values go in and come back out. So each row count is traced once, and a later pass of it is
one compiled call that rebuilds the same graph in MLX's C++.

Every row's KV is written with `put_along_axis`, never a slice at an array start: MLX's CUDA
backend runs that (DynamicSliceUpdate) as several launches
(bench/results/history/2026-12-02-h200-compiled-passes-issue28.md).

A pass is traced under the forms it runs with, and each kind keeps its own traces: plain
(`native_forms`, the engine's passes of non-deterministic rows) or canonical
(`calls_in_blocks` under the model's installed setting, the engine's deterministic passes).
Canonical passes run here only where the ragged proof ran them compiled and found every row
equal to its solo pass (kernels/batching/ragged_selftest.py, server/engine/guarantee/guarantee.py). The
pool's attention must be its kernel (the reference form slices by Python ints, which a trace
would freeze).
"""
from __future__ import annotations

import mlx.core as mx

from ..custom import attention as pool_attention
from ..custom.attention import PoolRows
from ..invariance.layers import calls_in_blocks, native_forms
from .kv_pool import pass_attention
from .ragged import PooledPass, RaggedLayerCache, RowPositions, pass_inputs


class _PassSlots:
    """A traced pass's PooledPass: where its rows go (arrays, so a trace serves every pass of
    its row count) and the pool it writes (the traced keys and values)."""

    def __init__(self, pool: "_TracedPool", slots: mx.array, base: mx.array, lens: mx.array):
        self.pool = pool
        self.slots = slots
        self.rows = PoolRows([], [], (base, lens))  # the kernel reads the arrays only

    def index(self, shape: tuple) -> mx.array:
        return mx.broadcast_to(self.slots[None, :, None], shape)


class _TracedPool:
    """The pool's keys and values inside a trace: writes make new arrays, the call returns them."""

    def __init__(self, pool, keys: list, values: list):
        self.pool = pool  # the KVPool: which kernels its passes may take
        self.keys, self.values = list(keys), list(values)

    def write_rows(self, layer: int, where: _PassSlots, keys: mx.array, values: mx.array) -> None:
        self.keys[layer] = mx.put_along_axis(self.keys[layer], where.index(keys.shape), keys, axis=1)
        self.values[layer] = mx.put_along_axis(self.values[layer], where.index(values.shape), values, axis=1)

    def attention(self, layer: int, queries: mx.array, rows: PoolRows, scale: float, sinks=None) -> mx.array:
        k_pool, v_pool = self.keys[layer], self.values[layer]
        if sinks is not None or not pool_attention.kernel_serves(queries, k_pool):
            raise NotCompilable("the pool's attention kernel does not take this layer")
        return pass_attention(self.pool, queries, k_pool, v_pool, rows, scale)


class _LayerRef:
    """What RaggedLayerCache reads of a request's layer cache inside a trace."""

    def __init__(self, layer: int):
        self.layer = layer
        self.offset = 0


class NotCompilable(RuntimeError):
    """The pass cannot be traced (it would freeze a Python value); it runs op by op."""


def unavailable_reason(pool) -> str | None:
    """Why passes over this pool cannot be compiled here (None: they can)."""
    if pool is None:
        return "no KV pool"
    if not pool.use_kernel:
        return "the pool's attention is its reference form"
    for dtype, dim in {(k.dtype, k.shape[-1]) for k in pool.keys}:
        problem = pool_attention.kernel_unavailable_reason(dtype, dim)
        if problem:
            return problem
    return None


class CompiledPasses:
    """A model's pool passes as compiled calls: one trace per (kind, row count), made on first use."""

    def __init__(self, model, pool):
        self.model = model
        self.pool = pool
        self.traces = 0  # how many passes were traced (each trace runs the model's Python once)
        self.forget()

    def forget(self) -> None:
        """Drop every trace (the model's installed forms changed): the next passes trace afresh."""
        self._runs = {False: mx.compile(self._plain_pass), True: mx.compile(self._canonical_pass)}

    def _plain_pass(self, *arrays):
        with native_forms():
            return self._pass(*arrays)

    def _canonical_pass(self, *arrays):
        with calls_in_blocks():
            return self._pass(*arrays)

    def _pass(self, tokens, positions, slots, base, lens, keys, values):
        """The traced pass: (logits, the pool's keys, its values) after writing this pass's KV."""
        self.traces += 1
        pool = _TracedPool(self.pool, keys, values)
        where = _PassSlots(pool, slots, base, lens)
        rows = RowPositions(positions)
        count = tokens.shape[1]
        caches = [RaggedLayerCache([_LayerRef(layer)], [count], rows, where) for layer in range(self.pool.layers)]
        logits = self.model(tokens, cache=caches).squeeze(0)
        return logits, pool.keys, pool.values

    def logits(self, requests: list[tuple[list, list[int]]], *, canonical: bool = False,
               tokens: mx.array | None = None) -> mx.array:
        """Logits (rows, vocab) of one ragged pass over pooled caches, the requests' rows end to
        end, as `ragged_logits` gives them under `native_forms` (canonical: under
        `calls_in_blocks`); each request's caches advance and the pool holds the pass's keys and
        values. `tokens`: the pass's (1, rows) int32 tokens as an array (still on the device),
        in place of the requests' own (then only their counts are read). Raises NotCompilable
        (nothing written) where the pass cannot be traced."""
        rows, given, positions = pass_inputs(requests)
        if tokens is None:
            tokens = given
        elif tokens.shape != given.shape or tokens.dtype != mx.int32:
            raise ValueError(f"a pass of {given.shape[1]} rows takes (1, {given.shape[1]}) int32 tokens, "
                             f"got {tokens.shape} {tokens.dtype}")
        where = PooledPass([cache[0] for cache, _ in requests], rows)  # checks each request's room
        base, lens = where.rows.arrays()
        logits, keys, values = self._runs[canonical](tokens, positions, where.slots, base, lens,
                                                     self.pool.keys, self.pool.values)
        self.pool.keys[:], self.pool.values[:] = keys, values
        for (cache, _), n in zip(requests, rows):
            for layer in cache:
                layer.offset += n
        return logits
