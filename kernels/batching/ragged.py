"""One forward pass over the rows of several requests, each with its own KV cache (a ragged batch).

    caches = [make_prompt_cache(model) for each request]           # prefilled separately
    logits = ragged_forward(model, [(caches[0], [t0]), (caches[1], [t1, d1, d2])])
    logits[0].shape == (1, vocab); logits[1].shape == (3, vocab)

The rows of all requests are laid end to end as one (1, T) sequence, so the linear layers see
M = T rows, exactly the rows there are (no padding). Two things of the model's forward are
per request, and are patched from outside the mlx-lm model files:
- positions: each layer's cache is a `RaggedLayerCache`, whose `offset` is a `RowPositions`
  (every row's absolute position in its own request); the model's RoPE modules get a
  subclass that applies it by treating each row as its own batch entry;
- attention: the model module's `scaled_dot_product_attention` name is the invariant
  wrapper (kernels/invariance/layers.py), which hands a ragged cache back here: each
  request's rows attend exactly its own keys, in the call that request would make alone.

A row therefore meets the same ops alone (a ragged pass of one request) and beside others;
that its bits are the same is proven per backend (`prove_ragged`), like every other form.

Layers whose state is not a plain KV cache (recurrent or conv state, `ArraysCache`; a
sliding window, `RotatingKVCache`) cannot take rows of several requests laid end to end:
their decoder layer is called once per request, on that request's rows and state, with the
mask its own cache makes (`_per_request_layer_class`). The layers with plain KV caches (the
attention layers of a hybrid model) still run once for the whole pass.

When the requests' caches live in one KV pool (kernels/batching/kv_pool.py), a layer writes all rows'
KV with one write and runs one attention call for all rows (kernels/custom/attention.py)
instead of one of each per request.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import inspect

from mlx_lm.models import rope_utils
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..custom.attention import PoolRows
# Cache kinds whose decoder layer runs once per request in a ragged pass (see above).
from ..invariance.cache_check import PER_REQUEST_CACHES
from .kv_pool import is_pooled

# RoPE classes whose call hands `offset` straight to mx.fast.rope (so a per-row position
# vector works once each row is its own batch entry).
ROPE_CLASSES = (nn.RoPE, rope_utils.Llama3RoPE, rope_utils.SuScaledRoPE, rope_utils.YarnRoPE,
                rope_utils.ProportionalRoPE)


class RowPositions:
    """Absolute positions of a ragged pass's rows; what `RaggedLayerCache.offset` returns.

    Not an int or an array on purpose: model code that would do arithmetic with it fails
    loudly instead of computing positions as if the rows were one sequence.
    """

    def __init__(self, positions: mx.array):
        self.positions = positions


class PooledPass:
    """Where a pass's rows go in a KV pool: each row's slot, and the keys each row sees."""

    def __init__(self, caches: list, rows: list[int]):
        self.pool = caches[0].pool
        slots, base, lens = [], [], []
        for cache, n in zip(caches, rows):
            start, offset = cache.span.start, cache.offset
            cache.span.check_room(offset + n)
            slots += range(start + offset, start + offset + n)
            base += [start] * n
            lens += range(offset + 1, offset + n + 1)
        self.slots = mx.array(slots, dtype=mx.int32)
        # One request's rows (or several whose slots happen to follow on): a slice write.
        self.first_slot = slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None
        self.rows = PoolRows(base, lens)
        self._index: dict[tuple, mx.array] = {}

    def index(self, shape: tuple) -> mx.array:
        """`slots` broadcast to a layer's (HKV, rows, D) keys, made once per pass and shape."""
        if shape not in self._index:
            self._index[shape] = mx.broadcast_to(self.slots[None, :, None], shape)
        return self._index[shape]


class RaggedLayerCache:
    """One layer's view of a ragged pass: the requests' own caches and their row counts."""

    def __init__(self, caches: list, rows: list[int], positions: RowPositions,
                 pooled: PooledPass | None = None, start_eval: bool = False):
        self.caches = caches
        self.rows = rows
        self._positions = positions
        self.pooled = pooled
        self.start_eval = start_eval  # hand the pass so far to the device here (ragged_logits)
        self.fetched: list[tuple[mx.array, mx.array]] = []

    @property
    def offset(self) -> RowPositions:
        return self._positions

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append each request's rows to its own cache; the attention reads `fetched`."""
        if self.start_eval:
            # This layer's keys and values depend on every earlier layer: the device runs those
            # while the host builds the rest of the pass. The same ops, so the same bits.
            mx.async_eval(keys, values)
        if self.pooled is not None:
            self.pooled.pool.write_rows(self.caches[0].layer, self.pooled, keys.squeeze(0), values.squeeze(0))
            for cache, n in zip(self.caches, self.rows):
                cache.offset += n
            return keys, values
        self.fetched = []
        start = 0
        for cache, n in zip(self.caches, self.rows):
            self.fetched.append(cache.update_and_fetch(keys[:, :, start:start + n],
                                                       values[:, :, start:start + n]))
            start += n
        return keys, values

    def make_mask(self, *args, **kwargs):
        return None  # each request's attention makes its own (see attention())

    def attend(self, sdpa, queries: mx.array, *, scale, sinks=None) -> mx.array:
        """Each request's query rows against its own keys, by `sdpa` (the model's attention
        function) exactly as that request's pass alone would call it; rows end to end.
        Pooled: all rows in one call, each against its own keys in the pool."""
        if self.pooled is not None:
            return self.pooled.pool.attention(self.caches[0].layer, queries, self.pooled.rows, scale, sinks)
        outs = []
        start = 0
        for cache, n, (keys, values) in zip(self.caches, self.rows, self.fetched):
            q = queries[:, :, start:start + n]
            extra = {} if sinks is None else {"sinks": sinks}
            outs.append(sdpa(q, keys, values, cache=cache, scale=scale,
                             mask=None if n == 1 else "causal", **extra))
            start += n
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


_rope_classes: dict[type, type] = {}


def _ragged_rope_class(cls: type) -> type:
    if cls not in _rope_classes:

        def __call__(self, x, offset=0, *args, **kwargs):
            if isinstance(offset, RowPositions):
                if x.shape[2] == 1:  # one row is already one batch entry: the same call, two view ops fewer
                    return cls.__call__(self, x, offset.positions, *args, **kwargs)
                # (1, H, T, D) -> (T, H, 1, D): each row a batch entry at its own position.
                y = cls.__call__(self, x.transpose(2, 1, 0, 3), offset.positions, *args, **kwargs)
                return y.transpose(2, 1, 0, 3)
            return cls.__call__(self, x, offset, *args, **kwargs)

        _rope_classes[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _rope_classes[cls]


_layer_classes: dict[type, type] = {}


def _per_request_layer_class(cls: type) -> type:
    """`cls` (a decoder layer) whose call, given a RaggedLayerCache, runs once per request:
    that request's rows, its own cache, and the mask that cache makes for them."""
    if cls not in _layer_classes:
        signature = inspect.signature(cls.__call__)

        def __call__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            cache = bound.arguments.get("cache")
            if not isinstance(cache, RaggedLayerCache):
                return cls.__call__(self, *args, **kwargs)
            arguments = dict(bound.arguments)
            arguments.pop("self")
            name = next(iter(arguments))  # the hidden states
            x, outs, start = arguments[name], [], 0
            for own, n in zip(cache.caches, cache.rows):
                arguments.update({name: x[:, start:start + n], "cache": own})
                if "mask" in signature.parameters:
                    arguments["mask"] = own.make_mask(n)
                outs.append(cls.__call__(self, **arguments))
                start += n
            return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

        _layer_classes[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _layer_classes[cls]


def _model_layers(model):
    layers = getattr(model, "layers", None)
    return list(layers) if layers is not None else None


def _state_kinds(model) -> list[type] | None:
    """Each layer's cache class (None: the model makes plain KV caches for every layer)."""
    if not hasattr(model, "make_cache"):
        return None
    return [type(c) for c in model.make_cache()]


def ragged_problem(model) -> str | None:
    """Why this model cannot run ragged passes (None: it can)."""
    from ..invariance.layers import model_module_names

    kinds = _state_kinds(model)
    if kinds is not None:
        odd = sorted({k.__name__ for k in kinds if k is not KVCache and not issubclass(k, PER_REQUEST_CACHES)})
        if odd:
            return f"its caches {odd} are neither plain KV caches nor per-request state"
        layers = _model_layers(model)
        if any(k is not KVCache for k in kinds) and (layers is None or len(layers) != len(kinds)):
            return "its per-request layers cannot be matched to its caches"
        if KVCache not in kinds and not any(k is RotatingKVCache for k in kinds):
            return "it has no attention layer to batch"
    ropes = [m for _, m in model.named_modules() if "rope" in type(m).__name__.lower()]
    if not ropes:
        return "no RoPE module found"
    odd = sorted({type(m).__name__ for m in ropes if not isinstance(m, ROPE_CLASSES)})
    if odd:
        return f"RoPE {odd} computes with its offset"
    import sys

    if not any(hasattr(sys.modules[n], "scaled_dot_product_attention") for n in model_module_names(model)):
        return "its attention does not go through mlx-lm's scaled_dot_product_attention"
    return None


def enable_ragged(model) -> None:
    """Patch the model's RoPE modules and attention name for ragged passes (idempotent).

    Raises ValueError when the model cannot (`ragged_problem`)."""
    from ..invariance.layers import hook_attention

    problem = ragged_problem(model)
    if problem:
        raise ValueError(f"ragged batches are not supported for this model: {problem}")
    for _, m in model.named_modules():
        if isinstance(m, ROPE_CLASSES) and type(m) not in _rope_classes.values():
            m.__class__ = _ragged_rope_class(type(m))
    kinds = _state_kinds(model) or []
    for layer, kind in zip(_model_layers(model) or [], kinds):
        if kind is not KVCache and type(layer) not in _layer_classes.values():
            layer.__class__ = _per_request_layer_class(type(layer))
    hook_attention(model)


def ragged_forward(model, requests: list[tuple[list, list[int]]]) -> list[mx.array]:
    """Logits (len(tokens), vocab) for each (cache, tokens) request, from one forward pass.

    Each request's rows are appended to its own cache. The model must have had
    `enable_ragged` applied.
    """
    return per_request(ragged_logits(model, requests), requests)


def per_request(logits: mx.array, requests: list[tuple[list, list[int]]]) -> list[mx.array]:
    """A pass's (rows, vocab) logits cut into each request's own rows, in order."""
    out, start = [], 0
    for _, tokens in requests:
        out.append(logits[start:start + len(tokens)])
        start += len(tokens)
    return out


def ragged_logits(model, requests: list[tuple[list, list[int]]], eval_every: int = 0) -> mx.array:
    """`ragged_forward`'s logits as one (rows, vocab) array, the requests' rows end to end.

    eval_every N > 0: while the graph is built, every N layers the part built so far starts
    evaluating (`mx.async_eval`), so the device works while the host builds the next layers
    instead of waiting for the whole graph (MLX builds a graph, then evaluates it)."""
    tokens, ragged = _ragged_inputs(requests, eval_every)
    return model(tokens, cache=ragged).squeeze(0)


def ragged_prompt_forward(model, requests: list[tuple[list, list[int]]]) -> mx.array:
    """Append each (cache, tokens) request's prompt chunk to its own cache in one pass, without
    the output head (a prompt chunk's logits are never used). Returns the body's output, to be
    evaluated with the caches (`call_without_head`)."""
    from ..invariance.layers import call_without_head

    return call_without_head(model, *_ragged_inputs(requests))


def _ragged_inputs(requests: list[tuple[list, list[int]]],
                   eval_every: int = 0) -> tuple[mx.array, list[RaggedLayerCache]]:
    """The pass's (1, rows) tokens and one RaggedLayerCache per layer (every `eval_every`-th
    one, from the `eval_every`-th on, starts evaluating what precedes it)."""
    rows, tokens, at = pass_inputs(requests)
    positions = RowPositions(at)
    layers = len(requests[0][0])
    pooled = (all(is_pooled(cache) for cache, _ in requests)
              and len({id(cache[0].pool) for cache, _ in requests}) == 1)
    # Every layer of a request shares its pool range and offset: one PooledPass serves all.
    where = PooledPass([cache[0] for cache, _ in requests], rows) if pooled else None
    ragged = [RaggedLayerCache([cache[layer] for cache, _ in requests], rows, positions, where,
                               start_eval=eval_every > 0 and layer > 0 and layer % eval_every == 0)
              for layer in range(layers)]
    return tokens, ragged


def pass_inputs(requests: list[tuple[list, list[int]]]) -> tuple[list[int], mx.array, mx.array]:
    """(rows per request, the pass's (1, rows) tokens, every row's absolute position)."""
    rows = [len(tokens) for _, tokens in requests]
    if any(n < 1 for n in rows):
        raise ValueError("every request in a ragged pass needs at least one row")
    positions = mx.array([cache_position(cache) + i for (cache, _), n in zip(requests, rows) for i in range(n)],
                         dtype=mx.int32)
    return rows, mx.array([t for _, ts in requests for t in ts], dtype=mx.int32)[None], positions


def cache_position(cache: list) -> int:
    """Tokens a request's caches hold: the offset of its first positional cache (recurrent
    state keeps no count)."""
    return next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))
