"""Prefill in canonical chunks, so a prompt whose prefix was already cached ends with the
same KV cache and next-token logits, bit for bit, as a cold prefill of the whole prompt (what
a deterministic request needs; a plain one resumes where its hit ends,
server/engine/decoding/request_state.py).

Chunk boundaries sit at multiples of `chunk` counted from position 0, never from where the
cached prefix happens to end: every position is computed in the same chunk shape either way.
If a whole chunk's rows are proven canonical (`canonical_rows` >= chunk: the deployment's
guarantee says so, server/engine/guarantee/guarantee.py), every row is computed as it would be alone,
so any cached prefix (from prefill or from decode) is already what a cold prefill writes.
Otherwise a prefix ending mid-chunk is rewound to its chunk's start and that chunk
recomputed whole.
"""
import mlx.core as mx

from .limit import installed_invariance


def canonical_rows(invariance) -> int:
    """The most rows of one request's call that the installed `invariance` (an
    InstalledInvariance or None) proved to get their solo (M = 1) bits: 0 unless guaranteed,
    one for a model with per-request state (its chunk is not its one-row calls)."""
    if invariance is None or not invariance.guaranteed:
        return 0
    return min(invariance.call_rows, invariance.request_rows or invariance.call_rows)


def rows_are_canonical(canonical: int, chunk: int) -> bool:
    """True when every row of a `chunk`-row call gets its solo bits (`canonical`: the most
    rows proven to)."""
    return chunk <= canonical


def resume_at(cached: int, chunk: int, canonical: int) -> int:
    """Where prefill resumes over `cached` positions: right there when a chunk's rows are
    canonical, else at the start of the chunk they end in (that chunk is recomputed whole)."""
    return cached if rows_are_canonical(canonical, chunk) else cached - cached % chunk


def chunk_end(pos: int, n_tokens: int, chunk: int) -> int:
    """End of the chunk starting at `pos`: the next multiple of `chunk`, or the prompt's end."""
    return min(n_tokens, (pos // chunk + 1) * chunk)


def aligned_start(cache_offset: int, n_tokens: int, chunk: int, canonical: int) -> int:
    """Where prefill must resume; never past the last token (its logits are the result)."""
    return resume_at(min(cache_offset, n_tokens - 1), chunk, canonical)


def prefill(model, tokens, cache, *, start: int | None = None, chunk: int = 512) -> mx.array:
    """Feed tokens[start:] (tokens: the whole prompt; tokens[:start] already in `cache`) in
    chunks aligned to absolute positions, canonical as far as the model's installed invariance
    proved. Returns the last token's logits, shape (vocab,).
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

    begin = aligned_start(offset, n, chunk, canonical_rows(installed_invariance(model)))
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
