"""Prefill in canonical chunks, so a prompt whose prefix was already cached ends with the
same KV cache and next-token logits, bit for bit, as a cold prefill of the whole prompt (what
a deterministic request needs; a plain one resumes where its hit ends,
server/engine/decoding/request_state.py).

Chunks end on a grid of absolute positions, never where a cached prefix happens to end, so
every position is computed in the same call either way. The grid halves below one chunk
(16, 32, 64, ... up to half a chunk, then every multiple of `chunk`): a short shared prefix (a
system prompt, an earlier turn) is reusable too, at the cost of a few narrow chunks at a long
prompt's start. A point below one chunk ends a prompt's chunk only when at least
`SMALLEST_CHUNK` tokens follow it (a shorter rest joins the chunk before, which stays within
half a chunk), so no prompt ends in a sliver too narrow to share a prefill pass
(kernels/batching/shared_prefill_proof.py). Which chunks a prompt runs depends on its length
and the grid alone, so positions up to a point that ends a chunk of both prompts hold the
same KV in both (`resume_at`, `exact_length`). A request with no determinism to keep takes
whole chunks (`chunk_end(halving=False)`): it resumes wherever its hit ends anyway, and the narrow
chunks would cost its cold prompts steps.
If a whole chunk's rows are proven canonical (`canonical_rows` >= chunk: the deployment's
guarantee says so, server/engine/guarantee/guarantee.py), every row is computed as it would be
alone, so any cached prefix (from prefill or from decode) is already what a cold prefill
writes. Otherwise a prefix is rewound to the last point that ends one of the prompt's chunks.
Where the deployment proved that a prompt may be cut anywhere into chunks of at least
`split_rows` rows (kernels/batching/split_prefill_proof.py: every position's KV is then the
same however the prompt was cut), there is no grid: a prefill resumes where its hit ends, or
`split_rows` before the prompt's end where fewer would be left, and chunks run a whole chunk
from wherever they start, the one before the end shortened so the last keeps `split_rows`.
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


# The grid's first point, and the fewest tokens a point below one chunk leaves after it: the
# narrowest chunk a deterministic request may prefill beside others (MIN_SHARED_CHUNK).
SMALLEST_CHUNK = 16


def _halving_points(chunk: int) -> list[int]:
    """The grid's points below one chunk: SMALLEST_CHUNK, twice that, ... up to half a chunk."""
    points, p = [], SMALLEST_CHUNK
    while p <= chunk // 2:
        points.append(p)
        p *= 2
    return points


def _ends_chunk(point: int, n_tokens: int, chunk: int) -> bool:
    """Whether a grid point below one chunk ends a chunk of an `n_tokens` prefill (or is its end)."""
    return point == n_tokens or point + SMALLEST_CHUNK <= n_tokens


def free_splits(split_rows: int, chunk: int) -> int:
    """`split_rows` (the fewest rows a chunk of a prompt cut anywhere needs, as proven; 0: not
    proven) where a chunk has room for two such pieces, else 0: the grid."""
    return split_rows if 0 < 2 * split_rows <= chunk else 0


def whole_chunks_are_canonical(chunk: int, canonical: int, split_rows: int = 0) -> bool:
    """Whether a prefill in whole chunks (`chunk_end(halving=False)`) writes the canonical KV:
    where rows are canonical, where a prompt may be cut anywhere, or where the grid has no
    point below one chunk."""
    return (rows_are_canonical(canonical, chunk) or free_splits(split_rows, chunk) > 0
            or not _halving_points(chunk))


def resume_at(cached: int, chunk: int, canonical: int, n_tokens: int, split_rows: int = 0) -> int:
    """Where a prefill of `n_tokens` resumes over `cached` positions: right there when a chunk's
    rows are canonical; where a prompt may be cut anywhere, there too unless fewer than
    `split_rows` tokens would follow (then that many before the end; none of a prompt shorter
    than that: its one chunk is narrower than any proven); else at the last grid point at or
    before `cached` that ends one of its chunks (the chunks after it are recomputed)."""
    if rows_are_canonical(canonical, chunk):
        return cached
    split_rows = free_splits(split_rows, chunk)
    if split_rows:
        if n_tokens < split_rows:
            return 0
        return cached if cached == n_tokens else min(cached, n_tokens - split_rows)
    start = cached - cached % chunk
    for point in _halving_points(chunk):
        if start < point <= cached and _ends_chunk(point, n_tokens, chunk):
            start = point
    return start


def chunk_end(pos: int, n_tokens: int, chunk: int, *, halving: bool = True, split_rows: int = 0) -> int:
    """End of the chunk starting at `pos` of an `n_tokens` prefill: the next grid point that
    ends one of its chunks, or the prompt's end. `halving` False: the next multiple of `chunk`
    (a plain request's chunks: the narrow ones only pay back where bits must match a cold run).
    Where a prompt may be cut anywhere (`split_rows`, see `free_splits`): a whole chunk on from
    `pos`, ending `split_rows` before the prompt's end where fewer would be left after it."""
    split_rows = free_splits(split_rows, chunk)
    if split_rows:
        end = min(n_tokens, pos + chunk)
        return n_tokens - split_rows if end < n_tokens < end + split_rows else end
    end = min(n_tokens, (pos // chunk + 1) * chunk)
    for point in _halving_points(chunk) if halving else ():
        if pos < point < end and _ends_chunk(point, n_tokens, chunk):
            return point
    return end


def exact_length(length: int, chunk: int, canonical: int, split_rows: int = 0) -> int:
    """How many of a `length`-token prefill's positions hold KV that every prompt sharing them
    computes the same: all where rows are canonical or a prompt may be cut anywhere (none of a
    prompt narrower than `split_rows`), else up to its last grid point that ends one of its
    chunks (the chunk after it was cut by this prompt's end)."""
    return resume_at(length, chunk, canonical, length, split_rows)


def aligned_start(cache_offset: int, n_tokens: int, chunk: int, canonical: int) -> int:
    """Where prefill must resume; never past the last token (its logits are the result)."""
    return resume_at(min(cache_offset, n_tokens - 1), chunk, canonical, n_tokens)


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
