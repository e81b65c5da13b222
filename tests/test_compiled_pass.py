"""Plain pool passes as compiled calls (kernels/batching/compiled_pass.py) and where the model
runner uses them.

The CPU has no pool kernel; `pool_kernel_double` stands in for it (tests/doubles/pool_kernel.py),
for the pass built op by op and the compiled one alike, so the two compare bit for bit here.
On the GPU the compiled pass runs the same primitives
(bench/results/history/2026-12-02-h200-compiled-passes-issue28.md).
"""
import logging

import mlx.core as mx
import numpy as np
import pytest

from lockstep.kernels.batching import compiled_pass
from lockstep.kernels.batching.compiled_pass import CompiledPasses, NotCompilable, unavailable_reason
from lockstep.kernels.batching.kv_pool import KVPool
from lockstep.kernels.batching.ragged import enable_ragged, ragged_logits
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.runner.model_runner import ModelRunner
from tests.doubles.pool_kernel import pool_kernel_double
from tests.tiny_models import tiny_llama

PROMPTS = ([1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4, 4, 4, 4])
# (request, rows) per pass: one row; three requests, one of them three rows (a verify pass);
# one row again (the first trace's row count); two requests whose slots do not follow on
PASSES = ([(0, [11])], [(0, [12]), (1, [13]), (2, [14, 15, 16])], [(1, [3])], [(0, [5]), (2, [6])])


@pytest.fixture(autouse=True, scope="module")
def pool_kernel():
    with pool_kernel_double():
        yield


def bits(x: mx.array) -> bytes:
    return np.array(x.astype(mx.float32)).tobytes()


def prefilled(model, pool) -> list:
    caches = [pool.allocate(24) for _ in PROMPTS]
    for cache, prompt in zip(caches, PROMPTS):
        mx.eval(ragged_logits(model, [(cache, prompt)]))
    return caches


@pytest.fixture(scope="module", params=[mx.float32, mx.float16], ids=["float32", "float16"])
def model(request):
    m = tiny_llama(dtype=request.param)
    enable_ragged(m)
    return m


def test_a_compiled_pass_gives_the_op_by_op_pass_bits_logits_and_kv(model):
    built, traced = KVPool(model, 128), KVPool(model, 128)
    by_ops, compiled = prefilled(model, built), prefilled(model, traced)
    passes = CompiledPasses(model, traced)
    for members in PASSES:
        want = ragged_logits(model, [(by_ops[i], rows) for i, rows in members])
        got = passes.logits([(compiled[i], rows) for i, rows in members])
        mx.eval(want, got)
        assert got.shape == want.shape and bits(got) == bits(want)
        assert [c[0].offset for c in compiled] == [c[0].offset for c in by_ops]
        assert all(layer.offset == cache[0].offset for cache in compiled for layer in cache)
    for k, v, k2, v2 in zip(built.keys, built.values, traced.keys, traced.values):
        assert bits(k) == bits(k2) and bits(v) == bits(v2)


def test_each_row_count_is_traced_once(model):
    pool = KVPool(model, 128)
    caches = prefilled(model, pool)
    passes = CompiledPasses(model, pool)
    for members in PASSES:
        mx.eval(passes.logits([(caches[i], rows) for i, rows in members]))
    # row counts 1, 5, 1, 2: the third pass replays the first one's trace
    assert passes.traces == 3


def test_a_pool_grown_between_passes_is_traced_at_its_new_size(model):
    built, traced = KVPool(model, 64), KVPool(model, 64)
    by_ops, compiled = prefilled(model, built), prefilled(model, traced)
    passes = CompiledPasses(model, traced)
    mx.eval(passes.logits([(compiled[0], [11])]), ragged_logits(model, [(by_ops[0], [11])]))
    grown = [pool.allocate(100) for pool in (built, traced)]  # beyond 64 slots: both pools double
    assert traced.capacity == built.capacity > 64
    for pool, cache in zip((built, traced), grown):
        mx.eval(ragged_logits(model, [(cache, [7, 8, 9])]))
    want = ragged_logits(model, [(by_ops[0], [12]), (grown[0], [13])])
    got = passes.logits([(compiled[0], [12]), (grown[1], [13])])
    assert bits(got) == bits(want) and passes.traces == 2


def test_a_pass_beyond_a_requests_reservation_writes_nothing(model):
    pool = KVPool(model, 64)
    cache = pool.allocate(6)
    mx.eval(ragged_logits(model, [(cache, [1, 2, 3, 4, 5])]))
    keys = bits(pool.keys[0])
    with pytest.raises(ValueError, match="outgrew its reservation"):
        CompiledPasses(model, pool).logits([(cache, [6, 7])])
    assert cache[0].offset == 5 and bits(pool.keys[0]) == keys


def test_passes_compile_only_over_the_pools_kernel(model):
    assert unavailable_reason(None) == "no KV pool"
    assert "reference form" in unavailable_reason(KVPool(model, 16, use_kernel=False))
    assert unavailable_reason(KVPool(model, 16)) is None  # the double's kernel


def _runner(model, **settings) -> ModelRunner:
    return ModelRunner(model, Deployment(kv_pool="kernel", **settings), pool_tokens=128)


class _Slot:
    def __init__(self, cache, determinism: str):
        self.state = type("State", (), {"cache": cache, "determinism": determinism,
                                        "presample": lambda self, logits: None})()


class _Pass:
    def __init__(self, members, canonical: bool):
        self.members, self.canonical = members, canonical


def test_the_runner_compiles_plain_decode_passes_only(model):
    runner = _runner(model)
    assert runner.compiled is not None
    assert runner.describe()["compiled_passes"] == {"plain": True, "deterministic": False}
    caches = prefilled(model, runner.kv_pool)
    result = runner.decode(_Pass([(_Slot(caches[0], "none"), [11]), (_Slot(caches[1], "none"), [12])], False))
    assert runner.compiled.traces == 1 and len(result.argmax) == 2
    runner.decode(_Pass([(_Slot(caches[0], "greedy"), [13])], True))  # a deterministic row: op by op
    assert runner.compiled.traces == 1 and caches[0][0].offset == len(PROMPTS[0]) + 2


@pytest.mark.parametrize("settings", [dict(compiled_passes=False), dict(async_eval_layers=1)])
def test_the_runner_builds_passes_op_by_op_when_told_or_when_evaluating_while_building(model, settings):
    assert _runner(model, **settings).compiled is None


def test_a_pass_that_cannot_be_traced_runs_op_by_op_from_then_on(model, monkeypatch, caplog):
    runner = _runner(model)
    caches = prefilled(model, runner.kv_pool)

    def refuse(*args, **kwargs):
        raise NotCompilable("the pool's attention kernel does not take this layer")

    monkeypatch.setattr(compiled_pass._TracedPool, "attention", refuse)
    with caplog.at_level(logging.WARNING):
        result = runner.decode(_Pass([(_Slot(caches[0], "none"), [11])], False))
    assert runner.compiled is None and "not compiled" in caplog.text
    assert result.logits.shape[0] == 1 and caches[0][0].offset == len(PROMPTS[0]) + 1  # advanced once


def test_serve_compiled_passes_reach_the_options():
    import argparse

    from lockstep.server.commands.runtime_args import options_from_args
    from lockstep.server.commands.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args([])).compiled_passes is True
    assert options_from_args(parser.parse_args(["--compiled-passes", "off"])).compiled_passes is False


# ------------------------------------------------------------- deterministic passes compiled

LIMIT = 4


@pytest.fixture
def deterministic_model():
    from tests.test_deterministic_double import peaked_llama

    m = peaked_llama()
    enable_ragged(m)
    yield m
    from lockstep.kernels.invariance import set_batch_invariant_limit

    set_batch_invariant_limit(m, 0)


def test_the_ragged_proof_of_compiled_passes_holds_with_canonical_forms_and_fails_natively(deterministic_model):
    from lockstep.kernels.batching.ragged_selftest import prove_ragged
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from tests.doubles.shape_variant import shape_variant_backend

    model = deterministic_model
    with shape_variant_backend():
        native = prove_ragged(model, LIMIT, kv_pool="kernel", compiled=True)
        assert not native and "differ" in native.reason  # negative control: the double varies with width
        assert set_batch_invariant_limit(model, LIMIT).guaranteed
        assert prove_ragged(model, LIMIT, kv_pool="kernel", compiled=True, pass_rows=6)
    refused = prove_ragged(model, LIMIT, kv_pool="reference", compiled=True)
    assert not refused and "pool's kernel" in refused.reason


def test_a_compiled_pass_whose_rows_move_with_the_width_fails_the_proof(deterministic_model, monkeypatch):
    from lockstep.kernels.batching.ragged_selftest import prove_ragged
    from lockstep.kernels.invariance import set_batch_invariant_limit

    model = deterministic_model
    assert set_batch_invariant_limit(model, LIMIT).guaranteed
    logits = CompiledPasses.logits

    def shifted(self, requests, **kwargs):  # a row's bits change once it shares the pass
        out = logits(self, requests, **kwargs)
        return out * (1 + 2 ** -10) if len(requests) > 1 else out

    monkeypatch.setattr(CompiledPasses, "logits", shifted)
    proof = prove_ragged(model, LIMIT, kv_pool="kernel", compiled=True)
    assert not proof and "differ" in proof.reason


def test_deterministic_passes_run_compiled_where_the_guarantee_proved_them(deterministic_model):
    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.server.engine.guarantee.deployment import proven_deployment

    model = deterministic_model
    invariance = set_batch_invariant_limit(model, LIMIT)
    deployment = proven_deployment(model, invariance, kv_pool="kernel", pass_rows=LIMIT)
    assert deployment.guarantee.guaranteed and deployment.guarantee.compiled_canonical_passes
    assert ModelRunner(model, deployment, pool_tokens=16).describe()["compiled_passes"]["deterministic"] is True
    off = proven_deployment(model, invariance, kv_pool="kernel", pass_rows=LIMIT, compiled_passes=False)
    assert off.guarantee.guaranteed and not off.guarantee.compiled_canonical_passes
    runner = ModelRunner(model, deployment, pool_tokens=128)
    caches = prefilled(model, runner.kv_pool)
    det = _Pass([(_Slot(caches[0], "greedy"), [11]), (_Slot(caches[1], "greedy"), [12])], True)
    runner.decode(det)
    assert runner.compiled.traces == 1  # the canonical pass, compiled
    runner.set_deployment(off)
    runner.decode(det)
    assert runner.compiled.traces == 1  # op by op now
