"""Bitwise proof that a deterministic prompt may be cut anywhere into chunks of at least
`shared_chunk_rows(L)` rows: every position's KV is then the same however the prompt was cut,
so a prefix-cache hit resumes where it ends, as a plain request's does, instead of at a grid
point before it (kernels/invariance/prefill.py, `split_rows`).

Such a chunk runs every linear natively (M > L), so whether a row keeps its bits in a call
of other width is the backend's matter (a GPU GEMM may pick its tiles by M), and so is
whether a row's attention depends on where its chunk starts and how many keys the call
holds (a CPU attention in blocks cut from the chunk's first row, a split over the keys). So
cuts are proven on the running backend: one prompt of a whole `--prefill-chunk` prefilled in
one call, then cut into a narrowest first piece, a narrowest last one and pieces at odd
offsets, every layer's KV compared as raw bits with the one call's (the engine's own path:
`call_without_head` on caches as the engine makes them). A backend may also pick its kernel
by the call's width (a GEMM's split-K for a few rows, a tile for many), so the prompt's first
w tokens alone are compared too, for widths around every power of two (`sweep`): a prompt's
pieces take every width, where the grid ran a few per length. A chunk in a shared pass keeps the
bits it has alone (kernels/batching/shared_prefill_proof.py), so together the two proofs let
a deterministic prompt resume anywhere at least that many rows before its end.
"""
from __future__ import annotations

import time

import mlx.core as mx

from ..invariance.layers import call_without_head
from ..invariance.selftest import new_state
from ..proof_steps import step_done
from .ragged_selftest import RaggedProof, _Caches, _vocab_size, cached_proof, differing_layer
from .shared_prefill_proof import shared_chunk_rows


def cuts(width: int, rows: int) -> list[tuple[int, ...]]:
    """Where the proof cuts a `width`-token prompt, every piece at least `rows` long: the first
    three of a narrowest first and last piece, one cut off the middle, pieces at odd offsets,
    and a narrowest first piece alone; none where two pieces do not fit."""
    candidates = [(rows, width - rows), (width // 2 + 1,), (rows + 1, 2 * rows + 3), (rows,)]
    found = []
    for points in candidates:
        pieces = [b - a for a, b in zip((0, *points), (*points, width))]
        if min(pieces) >= rows and points not in found:
            found.append(points)
    return found[:3]


def sweep(width: int, rows: int) -> list[int]:
    """The first pieces' widths compared alone: the narrowest and one more, and around every
    power of two (where kernels switch tiles or paths) one below, it, one above and halfway to
    the next; all below `width` (a chunk's own width is the one call's)."""
    widths, p = {rows, rows + 1}, 16
    while p <= width:
        widths |= {p - 1, p, p + 1, p + p // 2}
        p *= 2
    return sorted(w for w in widths if rows <= w < width)


def prove_prefill_splits(model, call_rows: int, width: int, *, seed: int = 0, kv_pool: str = "off") -> RaggedProof:
    """Whether a `width`-token prompt cut at each of `cuts`, and its first w tokens alone for
    each w of `sweep`, write its one call's KV, bit for bit."""
    start = time.perf_counter()
    rows = shared_chunk_rows(call_rows)
    plan = cuts(width, rows)
    if call_rows < 1 or not plan:
        return RaggedProof(False, call_rows, (), f"a {width}-token chunk has no room for two chunks of {rows} rows")
    made = _Caches(model, kv_pool, width, held=2)
    tokens = mx.random.randint(0, _vocab_size(model), (width,), key=mx.random.key(seed)).tolist()

    def prefill(points: tuple[int, ...], end: int = width) -> list:
        """The KV of the prompt's first `end` tokens, prefilled in calls cut at `points`."""
        cache = made.new()
        for a, b in zip((0, *points), (*points, end)):
            call_without_head(model, mx.array(tokens[a:b])[None], cache)
            mx.eval([c.state for c in cache])
        kv = new_state(cache, 0)
        mx.eval(kv)
        made.release([cache])
        return kv

    whole = prefill(())
    step_done()
    for points in plan:
        layer = differing_layer(whole, prefill(points))
        step_done()
        if layer is not None:
            return RaggedProof(False, call_rows, (), f"layer {layer} KV of a {width}-token prompt cut at "
                               f"{', '.join(map(str, points))} differs from its one call's",
                               time.perf_counter() - start)
    for w in sweep(width, rows):
        layer = differing_layer([[a[..., :w, :] for a in kv] for kv in whole], prefill((), w))
        step_done()
        if layer is not None:
            return RaggedProof(False, call_rows, (), f"layer {layer} KV of a {width}-token prompt's first {w} "
                               f"tokens alone differs from its one call's", time.perf_counter() - start)
    return RaggedProof(True, call_rows, (), "", time.perf_counter() - start)


def prove_prefill_splits_cached(model, call_rows: int, width: int, proof_cache=None, *, seed: int = 0,
                                kv_pool: str = "off") -> RaggedProof:
    """`prove_prefill_splits`, re-using a result proven earlier on this machine (a
    kernels.invariance.selftest.ProofCache: same model, strategy, L, code, MLX and device)."""
    if proof_cache is None:
        return prove_prefill_splits(model, call_rows, width, seed=seed, kv_pool=kv_pool)
    from ..invariance.selftest import proof_key

    key = {**proof_key(model, call_rows, (width,), (), seed, True, proof_cache.model_identity),
           "what": "prefill split proof", **({"kv_pool": kv_pool} if kv_pool != "off" else {})}
    return cached_proof(proof_cache, key, call_rows, (), lambda: prove_prefill_splits(model, call_rows, width,
                                                                                   seed=seed, kv_pool=kv_pool))
