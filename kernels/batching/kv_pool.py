"""A shared KV pool: every request's keys and values in one buffer per layer.

    pool = KVPool(model)
    cache = pool.allocate(tokens)       # a request's cache: one PooledLayerCache per layer
    model(tokens, cache=cache)          # mlx-lm's own model code; attention reads the pool
    pool.release(cache)

With each request's KV in its own caches, a pass over the rows of many requests needs a KV
write and an attention call per request per layer, and on a GPU those launches cost more
than the arithmetic. In the pool, a pass (kernels/batching/ragged.py) writes every row's KV with one
write per layer and runs one attention launch for all rows (kernels/custom/attention.py; a
plain pass, where the GPU has it, kernels/custom/split_attention.py: `pass_attention`).

A request holds one contiguous range of slots for its whole life, sized by its KV
reservation (prompt + max_tokens + drafts, server/engine/scheduling/kv_budget.py), so it never grows
mid-request. Ranges are handed out first-fit; when none fits, the pool doubles (between
passes, copying what it holds, a layer at a time) up to `max_capacity`, the engine's KV budget;
past that a request whose range does not fit waits (`can_allocate`). `PooledLayerCache` speaks the part of mlx-lm's KVCache API
the engine, the prefix cache and speculative rewinds use (offset, keys/values, state,
update_and_fetch, trim, make_mask).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask, make_prompt_cache

from ..custom import split_attention
from ..custom.attention import PoolRows, pooled_attention
from ..invariance.layers import active_setting
from .row_writes import write_rows_once

DEFAULT_CAPACITY = 4096


class PoolFull(RuntimeError):
    """No range of the asked length fits, and the pool may grow no further: the request waits."""


@dataclass
class Span:
    start: int
    length: int
    released: bool = False

    def check_room(self, positions: int) -> None:
        if positions > self.length:
            raise ValueError(f"a request's KV outgrew its reservation ({self.length} tokens)")


class PooledLayerCache:
    """One layer of one request's cache: its range of the pool and how much of it is filled."""

    def __init__(self, pool: "KVPool", layer: int, span: Span):
        self.pool = pool
        self.layer = layer
        self.span = span
        self.offset = 0

    @property
    def keys(self) -> mx.array:
        """(1, HKV, span, D): a view of this request's range (filled up to `offset`)."""
        return self.pool.keys[self.layer][None, :, self.span.start:self.span.start + self.span.length]

    @property
    def values(self) -> mx.array:
        return self.pool.values[self.layer][None, :, self.span.start:self.span.start + self.span.length]

    @property
    def state(self):
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append (1, HKV, n, D) keys/values; returns views of all keys/values so far."""
        n = keys.shape[2]
        self.span.check_room(self.offset + n)
        self.pool.write(self.layer, self.span.start + self.offset, keys.squeeze(0), values.squeeze(0))
        self.offset += n
        return self.state

    def load(self, keys: mx.array, values: mx.array) -> None:
        """Hold exactly these (1, HKV, n, D) keys/values (a prefix copied from elsewhere)."""
        self.offset = 0
        if keys.shape[2]:
            self.update_and_fetch(keys, values)

    def rows(self, count: int) -> PoolRows:
        """Where the last `count` positions' queries read: each sees the keys up to itself."""
        first = self.offset - count
        return PoolRows([self.span.start] * count, [first + i + 1 for i in range(count)])

    def attend(self, sdpa, queries: mx.array, *, scale, sinks=None) -> mx.array:
        """The queries of the positions just written, each against its own keys (one request's
        own pass over the pool, a prompt chunk; `sdpa` is not needed: the pool attends)."""
        return self.pool.attention(self.layer, queries, self.rows(queries.shape[2]), scale, sinks)

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        k, v = self.pool.keys[self.layer], self.pool.values[self.layer]
        return self.span.length * (k.nbytes // k.shape[1] + v.nbytes // v.shape[1])


def is_pooled(cache: list) -> bool:
    return bool(cache) and all(isinstance(c, PooledLayerCache) for c in cache)


def fill_prefix(cache: list[PooledLayerCache], source: list, length: int) -> None:
    """Make a pooled cache hold the first `length` positions of `source` (any cache whose
    layers have keys/values of shape (1, HKV, >= length, D)), bit for bit."""
    for dst, src in zip(cache, source):
        dst.load(src.keys[..., :length, :], src.values[..., :length, :])
    mx.eval(written_kv([cache]))


def written_kv(caches: list[list]) -> list:
    """What to evaluate so that every one of `caches` holds the KV written into it: each pool's
    per-layer arrays, once for all its ranges (a range's own views are two arrays a layer, so a
    pass of 32 requests over 32 layers would build 2,048 of them), and the layers' state of a
    cache outside a pool. Either way the same writes are evaluated."""
    pools, arrays = {}, []
    for cache in caches:
        if is_pooled(cache):
            pools[id(cache[0].pool)] = cache[0].pool
        else:
            arrays += [layer.state for layer in cache]
    for pool in pools.values():
        arrays += pool.keys + pool.values
    return arrays


class KVPool:
    """Per layer, keys and values of shape (HKV, capacity, D) and a first-fit allocator."""

    def __init__(self, model, capacity: int = DEFAULT_CAPACITY, *, use_kernel: bool = True,
                 max_capacity: int | None = None):
        self.use_kernel = use_kernel
        # the most slots it may grow to (the engine's KV budget): None, no bound
        self.max_capacity = max_capacity if max_capacity is None else max(max_capacity, capacity, 1)
        self._layouts = kv_layouts(model)
        # Plain passes may take the split kernel where it serves every layer's KV here.
        self.split_kernel = use_kernel and all(split_attention.kernel_unavailable_reason(dtype, k[1]) is None
                                               for k, _, dtype in self._layouts)
        self.capacity = 0
        self.keys: list[mx.array | None] = [None] * len(self._layouts)
        self.values: list[mx.array | None] = [None] * len(self._layouts)
        self._free: list[tuple[int, int]] = []  # (start, length), sorted, never adjacent
        self._grow(max(1, capacity))
        self._build_row_writes()

    def _build_row_writes(self) -> None:
        """Write rows once per KV dtype now (row_writes.py): the first pass that writes several
        requests' rows would otherwise wait for their kernel's compile."""
        for dtype in {dtype for _, _, dtype in self._layouts}:
            write_rows_once(dtype)

    @property
    def layers(self) -> int:
        return len(self._layouts)

    def _grow(self, capacity: int) -> None:
        """Layer by layer, each old layer let go once copied: the device holds the old pool
        and one new layer at most, not the old pool and the whole new one."""
        old = self.capacity
        for layer, ((kh, kd), (vh, vd), dtype) in enumerate(self._layouts):
            k, v = mx.zeros((kh, capacity, kd), dtype), mx.zeros((vh, capacity, vd), dtype)
            if old:
                k[:, :old] = self.keys[layer]
                v[:, :old] = self.values[layer]
            mx.eval(k, v)
            self.keys[layer], self.values[layer] = k, v
        self.capacity = capacity
        self._give_back(old, capacity - old)

    def can_allocate(self, tokens: int) -> bool:
        """Whether `allocate(tokens)` finds room: a free range that long, or growth up to
        `max_capacity` that makes one (the free range at the end grows with the pool)."""
        if any(length >= tokens for _, length in self._free):
            return True
        if self.max_capacity is None:
            return True
        tail = next((length for start, length in self._free if start + length == self.capacity), 0)
        return tail + self.max_capacity - self.capacity >= tokens

    def allocate(self, tokens: int) -> list[PooledLayerCache]:
        """A new request's cache with room for `tokens` positions (the pool grows if needed,
        doubling, up to `max_capacity`; PoolFull where even that leaves no range so long)."""
        if tokens < 1:
            raise ValueError("a request needs at least one KV slot")
        if not self.can_allocate(tokens):
            raise PoolFull(f"no free range of {tokens} KV slots in a pool of {self.capacity} "
                           f"({self.free_slots} free, at most {self.max_capacity})")
        start = self._first_fit(tokens)
        if start is None:
            grown = max(2 * self.capacity, self.capacity + tokens)
            self._grow(grown if self.max_capacity is None else min(grown, self.max_capacity))
            start = self._first_fit(tokens)
        span = Span(start, tokens)
        return [PooledLayerCache(self, layer, span) for layer in range(self.layers)]

    def release(self, cache: list[PooledLayerCache]) -> None:
        """Give a request's range back (idempotent)."""
        span = cache[0].span
        if not span.released:
            span.released = True
            self._give_back(span.start, span.length)

    def clone(self, cache: list[PooledLayerCache]) -> list[PooledLayerCache]:
        """A new range holding a copy of `cache`'s filled positions."""
        copy = self.allocate(cache[0].span.length)
        for dst, src in zip(copy, cache):
            keys, values = src.state
            if src.offset:
                dst.load(keys, values)
        return copy

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self._free)

    def write(self, layer: int, start: int, keys: mx.array, values: mx.array) -> None:
        """Slots start .. start + n of one layer get (HKV, n, D) keys/values."""
        n = keys.shape[1]
        self.keys[layer][:, start:start + n] = keys
        self.values[layer][:, start:start + n] = values

    def write_rows(self, layer: int, where, keys: mx.array, values: mx.array) -> None:
        """Row i of one layer's (HKV, R, D) keys/values goes to slot where.slots[i]
        (kernels/batching/ragged.PooledPass). Consecutive slots take a slice write;
        others `put_along_axis`, which MLX's CUDA backend runs faster than an indexed
        assignment."""
        if where.first_slot is not None:
            self.write(layer, where.first_slot, keys, values)
            return
        self.keys[layer] = mx.put_along_axis(self.keys[layer], where.index(keys.shape), keys, axis=1)
        self.values[layer] = mx.put_along_axis(self.values[layer], where.index(values.shape), values, axis=1)

    def attention(self, layer: int, queries: mx.array, rows: PoolRows, scale: float, sinks=None) -> mx.array:
        """queries (1, HQ, R, D), row r against its keys in this layer (`rows`)."""
        return pass_attention(self, queries, self.keys[layer], self.values[layer], rows, scale, sinks)

    def _first_fit(self, tokens: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= tokens:
                if length == tokens:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + tokens, length - tokens)
                return start
        return None

    def _give_back(self, start: int, length: int) -> None:
        if length <= 0:
            return
        free = sorted(self._free + [(start, length)])
        merged: list[tuple[int, int]] = []
        for s, n in free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged




def pass_attention(pool: KVPool, queries: mx.array, k_pool: mx.array, v_pool: mx.array, rows: PoolRows,
                   scale: float, sinks=None) -> mx.array:
    """One layer's attention for a pass over `pool` (k_pool / v_pool: that layer's keys and
    values). The one place that picks the kernel: a pass with no row under the guarantee (no
    active setting: `native_forms`, or L = 0) takes the split kernel where the pool has it;
    every other pass the pooled attention, whose order the self-tests prove."""
    if (pool.split_kernel and sinks is None and active_setting() is None
            and split_attention.kernel_serves(queries, k_pool)):
        return split_attention.kernel_attention(queries, k_pool, v_pool, rows, scale)
    return pooled_attention(queries, k_pool, v_pool, rows, scale, sinks=sinks, use_kernel=pool.use_kernel)


def kv_layouts(model) -> list[tuple[tuple[int, int], tuple[int, int], object]]:
    """Per layer ((key heads, key size), (value heads, value size), dtype) of this model's KV,
    read from a one-token pass."""
    probe = make_prompt_cache(model)
    model(mx.array([[0]]), cache=probe)
    return [((c.keys.shape[1], c.keys.shape[3]), (c.values.shape[1], c.values.shape[3]), c.keys.dtype)
            for c in probe]
