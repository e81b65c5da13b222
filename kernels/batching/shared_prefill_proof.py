"""Bitwise proof that prompt chunks of at least `shared_chunk_rows(L)` rows may share a pass
with other requests' chunks: each request's new KV is then what its chunk alone writes.

A deterministic request's prompt is prefilled in chunks (kernels/invariance/prefill.py),
without the output head. A chunk of more than L rows runs every linear natively (M > L),
alone or beside other chunks, so whether its rows keep their bits in the wider call of a
shared pass is the backend's matter: OpenBLAS blocks a GEMM's K by K alone, but takes a
small-matrix kernel for small calls; a GPU GEMM may pick its tiles by M. Attention is per
request in a ragged pass, norms and RoPE per row. So such chunks share a pass only where this
proof passed on the running backend: requests with and without a cached prefix, chunks of
the narrowest shareable size and wider, all in one ragged pass and two of them in another,
each compared with the same chunk run alone (the engine's own paths: `ragged_prompt_forward`
and the plain prompt call), every layer's new KV as raw bits. Narrower chunks (those of at
most L rows run canonical forms alone, natively in a shared pass) never share
(server/engine/decoding/request_state.py).
"""
from __future__ import annotations

import time

import mlx.core as mx

from ..invariance.layers import call_without_head
from ..invariance.selftest import new_state
from ..proof_steps import step_done
from .ragged import ragged_prompt_forward
from .ragged_selftest import RaggedProof, _Caches, _vocab_size, cached_proof, differing_layer


# The narrowest chunk that may share a pass, whatever L: below it a prefill pass is cheap
# anyway, and backends take other kernels for small calls (OpenBLAS's small-matrix path).
MIN_SHARED_CHUNK = 16


def shared_chunk_rows(call_rows: int) -> int:
    """The fewest rows a deterministic prompt chunk needs to share a prefill pass."""
    return max(call_rows + 1, MIN_SHARED_CHUNK)


def members(call_rows: int) -> list[tuple[int, int]]:
    """(cached prefix, chunk rows) of each request: the narrowest chunk that may share,
    wider ones, and prefixes that put chunks at other positions."""
    rows = shared_chunk_rows(call_rows)
    return [(0, rows), (11, rows + 1), (0, 2 * rows + 3), (37, max(33, rows))]


def prove_shared_prefill(model, call_rows: int, *, seed: int = 0, kv_pool: str = "off") -> RaggedProof:
    start = time.perf_counter()
    if call_rows < 1:
        return RaggedProof(False, call_rows, (), "the limit is 0")
    pool = members(call_rows)
    made = _Caches(model, kv_pool, max(prefix + rows for prefix, rows in pool), held=2 * len(pool))
    vocab = _vocab_size(model)
    keys = mx.random.split(mx.random.key(seed), len(pool))
    chunks, caches = [], []
    for (prefix, rows), key in zip(pool, keys):
        tokens = mx.random.randint(0, vocab, (prefix + rows,), key=key).tolist()
        cache = made.new()
        if prefix:
            call_without_head(model, mx.array(tokens[:prefix])[None], cache)
            mx.eval([c.state for c in cache])
        chunks.append(tokens[prefix:])
        caches.append(cache)

    alone = []
    for i, (prefix, _) in enumerate(pool):
        cache = made.copy(caches[i])
        call_without_head(model, mx.array(chunks[i])[None], cache)
        kv = new_state(cache, prefix)
        mx.eval(kv)
        alone.append(kv)
        made.release([cache])
    step_done()

    groups = (tuple(range(len(pool))), (0, 2))
    for group in groups:
        fresh = [made.copy(caches[i]) for i in group]
        ragged_prompt_forward(model, [(fresh[j], chunks[i]) for j, i in enumerate(group)])
        for j, i in enumerate(group):
            got = new_state(fresh[j], pool[i][0])
            mx.eval(got)
            layer = differing_layer(alone[i], got)
            if layer is not None:
                rows = sum(pool[k][1] for k in group)
                return RaggedProof(False, call_rows, groups, f"layer {layer} KV of a {pool[i][1]}-row prompt "
                                   f"chunk differs in a shared pass of {rows} rows",
                                   time.perf_counter() - start)
        made.release(fresh)
        step_done()
    return RaggedProof(True, call_rows, groups, "", time.perf_counter() - start)


def prove_shared_prefill_cached(model, call_rows: int, proof_cache=None, *, seed: int = 0,
                                kv_pool: str = "off") -> RaggedProof:
    """`prove_shared_prefill`, re-using a result proven earlier on this machine (a
    kernels.invariance.selftest.ProofCache: same model, strategy, L, code, MLX and device)."""
    if proof_cache is None:
        return prove_shared_prefill(model, call_rows, seed=seed, kv_pool=kv_pool)
    from ..invariance.selftest import proof_key

    key = {**proof_key(model, call_rows, tuple(r for _, r in members(call_rows)), (), seed, True,
                       proof_cache.model_identity),
           "what": "shared prefill proof", **({"kv_pool": kv_pool} if kv_pool != "off" else {})}
    return cached_proof(proof_cache, key, call_rows, (), lambda: prove_shared_prefill(model, call_rows, seed=seed,
                                                                                   kv_pool=kv_pool))
