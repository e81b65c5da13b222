"""Which caches keep the batch-invariance guarantee, and for how many rows of one request.

Per-query attention (kernels/invariance/ops.py) slices keys [0, p] for the query at absolute
position p, so a block of a request's rows needs a cache whose keys are stored in position
order, unquantized and complete (`cache_invariance_problem`). A rotating (sliding-window)
cache reorders and drops keys; recurrent state (ArraysCache) has no per-position keys at all;
a quantized cache runs a different attention; a batch cache left-pads rows, so a row never
sees what it sees alone.

Recurrent and sliding-window state still keeps a narrower guarantee: such a layer runs once
per request inside a ragged pass (kernels/batching/ragged.py), on that request's rows and its
own state, so one decode row is exactly its solo call. A model with such a layer is proven
for one row per request (`per_request_state`); only quantized, batch and unknown caches refuse
it outright (`cache_refusal`).
"""
from mlx_lm.models import cache as mlx_cache

# Caches whose update_and_fetch returns keys [0, offset) in position order, full precision.
POSITIONAL_CACHES = (mlx_cache.KVCache, mlx_cache.ConcatenateKVCache)
# Caches whose layer runs once per request in a ragged pass, with that request's own state.
PER_REQUEST_CACHES = (mlx_cache.ArraysCache, mlx_cache.RotatingKVCache)
_BATCH_CACHES = (mlx_cache.BatchKVCache, mlx_cache.BatchRotatingKVCache)


def is_positional(cache) -> bool:
    """True for no cache (keys are the whole sequence) or a plain positional KV cache."""
    return cache is None or type(cache) in POSITIONAL_CACHES


def is_per_request(cache) -> bool:
    """True for recurrent/conv state or a sliding window (not a batch cache)."""
    return isinstance(cache, PER_REQUEST_CACHES) and not isinstance(cache, _BATCH_CACHES)


def _why(c) -> str:
    if isinstance(c, _BATCH_CACHES):
        return "a batch cache left-pads rows, so a row never matches its solo computation"
    if isinstance(c, mlx_cache.RotatingKVCache):
        return "a sliding-window cache reorders and drops keys"
    if isinstance(c, mlx_cache.QuantizedKVCache) or hasattr(c, "bits"):
        return "a quantized KV cache runs a different attention kernel"
    if isinstance(c, mlx_cache.ArraysCache):
        return "recurrent state has no per-position keys to attend to one at a time"
    return "not a known positional KV cache"


def _first_problem(caches, allowed) -> str | None:
    for i, c in enumerate(caches):
        if isinstance(c, mlx_cache.CacheList):
            inner = _first_problem(c.caches, allowed)
            if inner:
                return f"layer {i}: {inner}"
            continue
        if not allowed(c):
            return f"layer {i}: {type(c).__name__}: {_why(c)}"
    return None


def cache_invariance_problem(caches) -> str | None:
    """Why this model cache (a list, one entry per layer) breaks the guarantee for a block of
    one request's rows (speculative verification, canonical prompt chunks), or None."""
    return _first_problem(caches, is_positional)


def cache_refusal(caches) -> str | None:
    """Why this model cache breaks even the one-row-per-request guarantee (quantized, batch or
    unknown caches), or None. A CacheList (several caches in one layer) is refused: its layer
    cannot run per request in a ragged pass."""
    for i, c in enumerate(caches):
        if isinstance(c, mlx_cache.CacheList):
            return f"layer {i}: CacheList: a layer with several caches cannot run per request"
    return _first_problem(caches, lambda c: is_positional(c) or is_per_request(c))


def per_request_state(caches) -> str | None:
    """The first layer whose cache is per-request state (recurrent/conv state or a sliding
    window), described, or None. Such a model is proven for one row per request in a pass:
    its layers' multi-row calls are not their one-row calls, and its state cannot be rewound
    past rejected drafts (no speculation) nor stored by the prefix cache."""
    for i, c in enumerate(caches):
        if is_per_request(c):
            kind = ("a sliding window" if isinstance(c, mlx_cache.RotatingKVCache)
                    else "recurrent or conv state")
            return f"layer {i}: {type(c).__name__} ({kind})"
    return None
