"""kernels/batching/shared_prefill_proof.py, and deterministic prompt chunks in shared prefill passes.

Where the deployment proved it, the prompt chunks (of at least `shared_chunk_rows(L)` rows) of
deterministic requests arriving together share a prefill pass, and every answer equals its
solo run bit for bit (tokens, logprobs, top logprobs), through the official openai client.
On a backend whose rows change between a narrow and a wide call (the shape-variant double
splitting only calls of more than 16 rows) the proof fails, and the same sharing claimed
without it changes answers: the negative control. The real OpenBLAS case is
tests/test_batching_openblas.py's server, which reports the proof.
"""
import dataclasses
import struct
import threading

import pytest
from openai import OpenAI

from lockstep.kernels.batching.ragged import enable_ragged
from lockstep.kernels.batching.shared_prefill_proof import MIN_SHARED_CHUNK, members, prove_shared_prefill
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.server.engine.runner.model_runner import ModelRunner
from tests.deterministic_fixtures import TinyLoaded
from tests.doubles.shape_variant import shape_variant_backend
from tests.http_server import running
from tests.test_batching import run_all
from tests.test_deterministic_double import peaked_llama
from tiny_models import tiny_llama

L = 2
TOKENS = 6
# Prompts of 17..29 tokens: one prefill chunk each (16..28 rows), all at least 16 rows; the
# 17-token one (a 16-row chunk) is what the negative control's double changes in a wide call.
PROMPTS = [[(11 * i + 7 * j) % 200 + 20 for j in range(17 + 4 * i)] for i in range(4)]
LOAD = [(i % 4, None if i % 2 else 30 + i) for i in range(8)]  # (prompt, seed or greedy)
NARROW_WIDE = MIN_SHARED_CHUNK  # the double's dense calls change order above this many rows


@pytest.mark.reference_blas
def test_the_proof_passes_where_wide_calls_keep_rows_and_fails_where_they_do_not():
    model = tiny_llama()
    set_batch_invariant_limit(model, 4)
    enable_ragged(model)
    assert prove_shared_prefill(model, 4)  # the reference BLAS: rows never depend on M
    assert min(rows for _, rows in members(4)) == MIN_SHARED_CHUNK == 16
    assert min(rows for _, rows in members(20)) == 21  # never a chunk of at most L rows
    with shape_variant_backend(dense_rows=NARROW_WIDE):
        model = tiny_llama()
        set_batch_invariant_limit(model, 4)
        enable_ragged(model)
        proof = prove_shared_prefill(model, 4)
    assert not proof and "prompt chunk differs in a shared pass" in proof.reason


def completion(client, prompt: int, seed, stream: bool):
    """(token ids, logprob bits, top-logprob bits) of one deterministic /v1/completions call."""
    kwargs = dict(model="default", prompt=PROMPTS[prompt], max_tokens=TOKENS, logprobs=3,
                  temperature=0.8 if seed is not None else 0.0, extra_body={"deterministic": True})
    if seed is not None:
        kwargs["seed"] = seed
    text, lps, tops = "", [], []
    if stream:
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs:
                c = chunk.choices[0]
                text, lps, tops = text + c.text, lps + c.logprobs.token_logprobs, tops + c.logprobs.top_logprobs
    else:
        c = client.completions.create(**kwargs).choices[0]
        text, lps, tops = c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs
    return ([ord(ch) - 0x4E00 for ch in text], [struct.pack(">d", x) for x in lps],
            [sorted((t, struct.pack(">d", v)) for t, v in top.items()) for top in tops])


def serve(dense_rows: int, claim: bool = False):
    """(app, engine) for the tiny model at L = 2 under the double, its guarantee decided as
    at startup; `claim`: shared prefill claimed whatever the proof said. No prefix cache (the
    solo runs would otherwise leave every prompt's KV for the load)."""
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.deployment import proven_deployment

    model = peaked_llama()
    with shape_variant_backend(dense_rows=dense_rows):
        invariance = set_batch_invariant_limit(model, L)
        deployment = proven_deployment(model, invariance, prefill_chunk=64, pass_rows=16)
    if claim:
        deployment = dataclasses.replace(
            deployment, guarantee=dataclasses.replace(deployment.guarantee, shared_prefill_rows=MIN_SHARED_CHUNK))
    engine = Engine(TinyLoaded(model), max_active=16, deployment=deployment, max_batch_rows=16)
    return create_app(engine), engine


def load_and_solo(monkeypatch, dense_rows: int, claim: bool = False):
    """(solo answers, answers when all arrive together, (determinism, chunk rows) of every
    request in a shared prefill pass, the engine)."""
    shared = []
    original = ModelRunner.prefill_shared

    def logged(self, states):
        shared.extend((s.determinism, s.next_chunk_tokens()) for s in states)
        return original(self, states)

    monkeypatch.setattr(ModelRunner, "prefill_shared", logged)
    app, engine = serve(dense_rows, claim)
    engine.start()
    try:
        with shape_variant_backend(dense_rows=dense_rows), running(app) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            solo = {i: completion(client, p, seed, False) for i, (p, seed) in enumerate(LOAD)}
            assert shared == []  # alone, nothing shares
            together, errors = {}, []

            def run(i):
                try:
                    p, seed = LOAD[i]
                    together[i] = completion(client, p, seed, i % 3 == 0)
                except Exception as exc:  # surfaced by run_all
                    errors.append(exc)

            run_all([threading.Thread(target=run, args=(i,)) for i in range(len(LOAD))], errors)
    finally:
        engine.stop()
    return solo, together, shared, engine


@pytest.mark.reference_blas
def test_deterministic_chunks_share_prefill_passes_and_keep_their_solo_bits(monkeypatch):
    solo, together, shared, engine = load_and_solo(monkeypatch, dense_rows=1)
    assert engine.deployment.guarantee.shared_prefill_rows == MIN_SHARED_CHUNK
    assert engine.describe()["deterministic_prefill_rows"] == MIN_SHARED_CHUNK
    deterministic = [rows for determinism, rows in shared if determinism == "shared"]
    assert len(deterministic) >= 2  # deterministic requests' chunks really shared passes
    assert all(rows >= MIN_SHARED_CHUNK for rows in deterministic)
    for i in solo:
        assert len(solo[i][0]) == TOKENS
        assert together[i] == solo[i], f"deterministic request {i} changed when its prompt shared a pass"


@pytest.mark.reference_blas
def test_negative_control_sharing_without_the_proof_changes_answers(monkeypatch):
    _, engine = serve(NARROW_WIDE)
    assert engine.deployment.guarantee.shared_passes and engine.deployment.guarantee.shared_prefill_rows == 0  # refused
    solo, together, shared, _ = load_and_solo(monkeypatch, dense_rows=NARROW_WIDE, claim=True)
    assert any(determinism == "shared" for determinism, _ in shared)
    assert any(together[i] != solo[i] for i in solo), "sharing on a backend that changes rows kept every answer"


def test_without_the_proof_deterministic_chunks_run_alone_and_keep_their_bits(monkeypatch):
    solo, together, shared, engine = load_and_solo(monkeypatch, dense_rows=NARROW_WIDE)
    assert engine.deployment.guarantee.shared_prefill_rows == 0
    assert all(determinism != "shared" for determinism, _ in shared)
    for i in solo:
        assert together[i] == solo[i]


@pytest.mark.reference_blas
@pytest.mark.parametrize("dense_rows,stored", [(1, 3), (NARROW_WIDE, 0)])
def test_kv_of_a_proven_shared_pass_reaches_the_prefix_cache_and_unproven_kv_never(dense_rows, stored):
    """Three requests' prompts (chunks of 16, 20 and 24 rows) prefilled in one shared pass:
    their KV is stored for later requests only where the proof said such chunks keep it."""
    from lockstep.server.engine.cache.prefix_cache import PrefixCache
    from tests.test_shared_prefill import request, run_together

    cache = PrefixCache(8)
    requests = [request(PROMPTS[i]) for i in range(3)]
    _, log, engine = run_together(requests, limit=L, double=True, prefix_cache=cache, dense_rows=dense_rows)
    assert any(n == 3 for _, n in log.shared)  # the three prompts in one pass
    assert (engine.deployment.guarantee.shared_prefill_rows > 0) == (stored > 0)
    assert len(cache._store) == stored
