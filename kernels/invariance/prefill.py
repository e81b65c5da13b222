"""Prefill in canonical chunks, so a prompt whose prefix was already cached ends with the
same KV cache and next-token logits, bit for bit, as a cold prefill of the whole prompt.

Chunk boundaries sit at multiples of `chunk` counted from position 0, never from where the
cached prefix happens to end: every position is computed in the same chunk shape either way.
If the model's batch-invariant limit covers a whole chunk (plan guaranteed, L >= chunk),
every row is computed as it would be alone, so any cached prefix (from prefill or from
decode) is already what a cold prefill writes. Otherwise a prefix ending mid-chunk is rewound
to its chunk's start and that chunk recomputed whole.
"""
import mlx.core as mx

from .limit import installed_invariance


def rows_are_canonical(model, chunk: int) -> bool:
    """True when every row of a `chunk`-row call is proven to get its solo (M = 1) bits (never
    for a model with per-request state beyond one row: its chunk is not its one-row calls)."""
    plan = installed_invariance(model)
    return plan is not None and plan.guaranteed and chunk <= min(plan.limit, plan.request_rows or plan.limit)


def resume_at(model, cached: int, chunk: int) -> int:
    """Where prefill resumes over `cached` positions: right there when rows are canonical,
    else at the start of the chunk they end in (that chunk is recomputed whole)."""
    return cached if rows_are_canonical(model, chunk) else cached - cached % chunk


def chunk_end(pos: int, n_tokens: int, chunk: int) -> int:
    """End of the chunk starting at `pos`: the next multiple of `chunk`, or the prompt's end."""
    return min(n_tokens, (pos // chunk + 1) * chunk)


def aligned_start(model, cache_offset: int, n_tokens: int, chunk: int) -> int:
    """Where prefill must resume; never past the last token (its logits are the result)."""
    return resume_at(model, min(cache_offset, n_tokens - 1), chunk)


def prefill(model, tokens, cache, *, start: int | None = None, chunk: int = 512) -> mx.array:
    """Feed tokens[start:] (tokens: the whole prompt; tokens[:start] already in `cache`) in
    chunks aligned to absolute positions. Returns the last token's logits, shape (vocab,).
    The cache may be rewound a little (see aligned_start); it ends holding all of `tokens`."""
    tokens = mx.array(tokens) if not isinstance(tokens, mx.array) else tokens
    n = tokens.shape[-1]
    if n == 0:
        raise ValueError("prefill needs at least one token")
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    offset = cache[0].offset if cache else 0
    if start is not None and start != offset:
        raise ValueError(f"start={start} but the cache holds {offset} tokens")
    if offset > n:
        raise ValueError(f"the cache holds {offset} tokens, more than the {n}-token prompt")

    begin = aligned_start(model, offset, n, chunk)
    if begin < offset:
        if not all(c.is_trimmable() for c in cache):
            raise ValueError("the cache cannot be rewound to a chunk boundary")
        for c in cache:
            c.trim(offset - begin)

    tokens = tokens.reshape(1, n)
    pos = begin
    while True:
        end = chunk_end(pos, n, chunk)
        logits = model(tokens[:, pos:end], cache=cache)
        if end == n:
            last = logits[0, -1]
            mx.eval(last, [c.state for c in cache])
            return last
        mx.eval([c.state for c in cache])  # earlier chunks' logits are never computed
        pos = end
