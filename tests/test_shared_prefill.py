"""Prompt chunks of several requests in one prefill pass (issue 8: many arrivals start together).

Chunks of requests with no determinism to keep share a ragged pass; a deterministic request's
chunks run alone unless the deployment proved that chunks of more than L rows keep their KV in
shared passes (tests/test_shared_prefill_proof.py), and KV from an unproven shared pass never
reaches the prefix cache (a later deterministic request may start from an entry). On this CPU's bundled BLAS a pass's rows do
not depend on their neighbours, so a request prefilled beside others must give exactly its
solo answer: that checks the shared pass's positions and caches.
"""
import asyncio
import struct
import threading

import numpy as np
from mlx_lm.models.cache import make_prompt_cache
import pytest

from lockstep.kernels.batching.ragged import enable_ragged, ragged_prompt_forward
from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import proven_deployment
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from lockstep.server.engine.runner.model_runner import prompt_forward
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.test_deterministic_double import peaked_llama

PROMPTS = [[11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12], [30, 31, 32, 33, 30, 31, 32],
           [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 50], [70, 71, 70, 71, 70]]
TOKENS = 12


class PrefillLog:
    def __init__(self):
        self.shared = []  # (rows, requests) of every shared prefill pass

    def on_prefill(self, rows, requests):
        self.shared.append((rows, requests))


def run_together(requests, *, limit=0, kv_pool="off", double=False, prefix_cache=None, observers=(),
                 dense_rows=1):
    """Submit every (request, deterministic) before the engine starts, so all are admitted and
    prefilled in the same iterations: ({index: (tokens, logprob bits)}, PrefillLog, engine).
    dense_rows: the double's dense calls change order above this many rows."""
    from lockstep.server.engine import Engine

    model = peaked_llama()
    invariance = None
    if limit:
        with shape_variant_backend(dense_rows=dense_rows):
            invariance = set_batch_invariant_limit(model, limit)
        assert invariance.guaranteed
    with shape_variant_backend(dense_rows=dense_rows):
        deployment = proven_deployment(model, invariance, prefill_chunk=64, kv_pool=kv_pool)
    log = PrefillLog()

    async def main():
        engine = Engine(TinyLoaded(model), max_active=16, deployment=deployment, prefix_cache=prefix_cache)
        engine.observers += [log, *observers]
        handles = [engine.submit(r, plan_request(deployment, deterministic=deterministic, speculative=None,
                                                 num_draft_tokens=None)) for r, deterministic in requests]
        engine.start()
        try:
            out = {}
            for i, handle in enumerate(handles):
                text, bits = "", []
                async for delta in handle:
                    text += delta.text
                    bits += [struct.pack(">d", lp.logprob) for lp in delta.logprobs]
                out[i] = ([ord(ch) - 0x4E00 for ch in text], bits)
            return out, engine
        finally:
            engine.stop()

    if double:
        with shape_variant_backend(dense_rows=dense_rows):
            out, engine = asyncio.run(main())
    else:
        out, engine = asyncio.run(main())
    return out, log, engine


def request(prompt, *, deterministic=False, seed=None):
    """(request, whether it asks for determinism): what run_together submits."""
    sampling = SamplingParams(temperature=0.7 if seed is not None else 0.0, seed=seed, top_logprobs=2)
    return GenerationRequest(list(prompt), TOKENS, sampling), deterministic


@pytest.mark.reference_blas
@pytest.mark.parametrize("kv_pool", ["off", "reference"])
def test_requests_prefilled_in_one_shared_pass_give_their_solo_answers(kv_pool):
    from lockstep.server.api.metrics import Metrics

    metrics = Metrics()
    requests = [request(p, seed=(None if i % 2 else 40 + i)) for i, p in enumerate(PROMPTS)]
    together, log, _ = run_together(requests, kv_pool=kv_pool, observers=[metrics])
    assert any(n == len(PROMPTS) for _, n in log.shared)  # all four prompts' first chunks in one pass
    exposition = metrics.exposition()[0].decode()
    assert f"lockstep_prefill_pass_requests_count {float(len(log.shared))}" in exposition
    for i, r in enumerate(requests):
        alone, alone_log, _ = run_together([r], kv_pool=kv_pool)
        assert not alone_log.shared
        assert len(together[i][0]) == TOKENS
        assert together[i] == alone[0], f"request {i} changed when prefilled beside others"


def test_unproven_deterministic_chunks_never_share_and_shared_kv_never_reaches_the_prefix_cache():
    """Shape-variant double whose dense calls change order above 16 rows, L = 6 installed: the
    shared-prefill proof fails there. The rule is asserted as it is (no deterministic request
    in a shared pass, no shared KV in the prefix cache): wide native passes here may happen to
    give the solo bits, so equal answers alone would not show it."""
    narrow_wide = dict(limit=6, double=True, dense_rows=16)
    deterministic = [request(PROMPTS[0], deterministic=True), request(PROMPTS[2], deterministic=True, seed=5)]
    solo = [run_together([r], **narrow_wide)[0][0] for r in deterministic]
    cache = PrefixCache(8)
    others = [request(p) for p in PROMPTS] + [request(PROMPTS[0], seed=3)]
    together, log, engine = run_together(others + deterministic, prefix_cache=cache, **narrow_wide)
    assert engine.deployment.guarantee.shared_prefill_rows == 0
    for j, expected in enumerate(solo):
        assert together[len(others) + j] == expected
    assert log.shared and all(n <= len(others) for _, n in log.shared)
    assert len(cache._store) == len(deterministic)  # only the solo-prefilled prompts were stored
    # Then the same deterministic request again starts from its own stored prompt (whole: it is
    # that prompt's cold prefill) and still matches its solo run.
    again, _, _ = run_together([deterministic[0]], prefix_cache=cache, **narrow_wide)
    assert cache.hits == 1 and again[0] == solo[0]


@pytest.mark.reference_blas
def test_ragged_prompt_forward_writes_the_kv_of_each_prompt_alone():
    model = peaked_llama()
    enable_ragged(model)
    chunks = [PROMPTS[0][:8], PROMPTS[1][:5], PROMPTS[3][:3]]
    together = [make_prompt_cache(model) for _ in chunks]
    ragged_prompt_forward(model, list(zip(together, chunks)))
    for cache, chunk in zip(together, chunks):
        alone = make_prompt_cache(model)
        prompt_forward(model, alone, chunk)
        for a, b in zip(cache, alone):
            assert a.offset == b.offset == len(chunk)
            for x, y in zip(a.state, b.state):
                assert np.array_equal(np.array(x), np.array(y))


def test_decode_passes_run_canonical_forms_only_for_requests_that_asked_for_determinism(monkeypatch):
    """With L installed every pass of <= L rows could run the canonical forms; a pass with no
    deterministic request runs natively instead (it only costs time there)."""
    import lockstep.kernels.invariance.layers as layers

    one_row_calls = []
    active = layers.active_setting

    def counted():  # settings seen by linears and attention on the engine thread (not the startup self-test)
        s = active()
        if s is not None and threading.current_thread().name == "lockstep-engine":
            one_row_calls.append(s.strategy.name)
        return s

    monkeypatch.setattr(layers, "active_setting", counted)
    # One-token prompts: no prefill chunk, so every linear call with one row is a decode row.
    run_together([request([11], deterministic=True)], limit=6, double=True)
    deterministic_calls = len(one_row_calls)
    one_row_calls.clear()
    run_together([request([11])], limit=6, double=True)
    assert deterministic_calls >= TOKENS  # the deterministic request's decode ran canonical forms
    assert one_row_calls == []           # the other one's never did
