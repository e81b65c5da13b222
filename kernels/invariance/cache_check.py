"""Which KV caches keep the batch-invariance guarantee.

Per-query attention (kernels/invariance/ops.py) slices keys [0, p] for the query at absolute
position p, so it needs a cache whose keys are stored in position order, unquantized and
complete. A rotating (sliding-window) cache reorders and drops keys; a quantized cache runs
a different attention; a batch cache left-pads rows, so a row never sees what it sees alone;
recurrent state (ArraysCache) has no per-position keys at all.
"""
from mlx_lm.models import cache as mlx_cache

# Caches whose update_and_fetch returns keys [0, offset) in position order, full precision.
POSITIONAL_CACHES = (mlx_cache.KVCache, mlx_cache.ConcatenateKVCache)


def is_positional(cache) -> bool:
    """True for no cache (keys are the whole sequence) or a plain positional KV cache."""
    return cache is None or type(cache) in POSITIONAL_CACHES


def cache_invariance_problem(caches) -> str | None:
    """Why this model cache (a list, one entry per layer) breaks the guarantee, or None."""
    for i, c in enumerate(caches):
        if isinstance(c, mlx_cache.CacheList):
            inner = cache_invariance_problem(c.caches)
            if inner:
                return f"layer {i}: {inner}"
            continue
        if is_positional(c):
            continue
        name = type(c).__name__
        if isinstance(c, mlx_cache.RotatingKVCache):
            why = "a sliding-window cache reorders and drops keys"
        elif isinstance(c, mlx_cache.QuantizedKVCache) or hasattr(c, "bits"):
            why = "a quantized KV cache runs a different attention kernel"
        elif isinstance(c, (mlx_cache.BatchKVCache, mlx_cache.BatchRotatingKVCache)):
            why = "a batch cache left-pads rows, so a row never matches its solo computation"
        elif isinstance(c, mlx_cache.ArraysCache):
            why = "recurrent state has no per-position keys to attend to one at a time"
        else:
            why = "not a known positional KV cache"
        return f"layer {i}: {name}: {why}"
    return None
