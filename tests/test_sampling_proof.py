"""The batched-sampling proof (server/engine/decoding/sampling_proof.py) and its gate: on this
backend a batch of 2..W rows gives every row its bits alone and the proof credits every width;
a sampler whose batches change a row's bits from 5 rows on (tests/doubles/width_variant_sampler.py)
is proven for 2..4 only, and deterministic rows then sample in blocks of at most 4, each row's
bits its own alone, while the same sampler with a width the proof did not give changes a
deterministic row's bits (the negative control). Until the proof ran, deterministic rows
sample alone; plain rows batch at any width."""
import struct
import types
from dataclasses import replace

import httpx2 as httpx
import mlx.core as mx
import pytest

from lockstep.kernels.invariance.selftest import ProofCache
from lockstep.kernels.verdict_cache import VerdictCache
from lockstep.server.engine.decoding import sampling
from lockstep.server.engine.decoding.sampling import SamplingParams, sample_pending
from lockstep.server.engine.decoding.sampling_proof import prove_batched_sampling
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.runner.decode_ahead import presample_pass
from tests.doubles.width_variant_sampler import width_variant_sampler

VOCAB = 300  # the proof's cost grows with it; the served model's in `serve`
WIDEST = 7
VARIES_FROM = 5


def bits(sampled) -> tuple:
    pack = lambda x: None if x is None else struct.pack("<f", x)  # noqa: E731
    return (sampled.token, pack(sampled.logprob), tuple((t, pack(v)) for t, v in sampled.top_logprobs))


@pytest.fixture
def varying(monkeypatch):
    """The sampler whose batches of VARIES_FROM rows or more change their rows' bits."""
    monkeypatch.setattr(sampling, "sample_pending", width_variant_sampler(VARIES_FROM))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_the_proof_passes_here_and_credits_every_width(dtype):
    proof = prove_batched_sampling(VOCAB, dtype, WIDEST)
    assert proof.rows == WIDEST and not proof.cached, proof.reason
    assert f"2..{WIDEST}" in proof.reason


def test_a_sampler_that_varies_from_a_width_is_proven_for_the_widths_below_it(varying):
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST)
    assert proof.rows == VARIES_FROM - 1, proof.reason
    assert f"batch of {VARIES_FROM} rows differs" in proof.reason


def test_a_sampler_that_varies_at_two_rows_is_proven_for_none(monkeypatch):
    monkeypatch.setattr(sampling, "sample_pending", width_variant_sampler(2))
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST)
    assert proof.rows == 0 and "batch of 2 rows differs" in proof.reason


def test_a_key_mix_up_shows(monkeypatch):
    """A batch that keys every row on its first row's seed: rows 0 and 1 share a seed (their
    positions differ), so a batch of 2 is right; from 3 rows on a row with a seed of its own
    gets another's, and the proof credits 2."""
    real = sampling.sample_pending

    def first_seed_for_all(logits, positions, params, model_logits=None, seeds=None):
        return real(logits, positions, params, model_logits, None if seeds is None else [seeds[0]] * len(seeds))

    monkeypatch.setattr(sampling, "sample_pending", first_seed_for_all)
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST)
    assert proof.rows == 2 and "batch of 3 rows differs" in proof.reason, proof.reason


def test_the_verdict_is_kept_per_machine_and_never_meets_a_double(tmp_path, monkeypatch):
    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    first = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    again = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert (first.rows, first.cached, again.rows, again.cached) == (WIDEST, False, WIDEST, True)
    narrower = prove_batched_sampling(VOCAB, mx.float32, 3, proof_cache=proofs)
    assert (narrower.rows, narrower.cached) == (3, True)
    other_vocab = prove_batched_sampling(VOCAB + 1, mx.float32, WIDEST, proof_cache=proofs)
    assert not other_vocab.cached
    other_dtype = prove_batched_sampling(VOCAB, mx.bfloat16, WIDEST, proof_cache=proofs)
    assert not other_dtype.cached
    fresh = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=replace(proofs, fresh=True))
    assert not fresh.cached and not fresh.resumed
    monkeypatch.setattr(sampling, "sample_pending", width_variant_sampler(VARIES_FROM))
    variant = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert (variant.rows, variant.cached) == (VARIES_FROM - 1, False)
    kept = prove_batched_sampling(VOCAB, mx.float32, WIDEST + 3, proof_cache=proofs)
    assert (kept.rows, kept.cached) == (VARIES_FROM - 1, True)  # the width that differed is kept too


def test_a_wider_proof_and_a_stopped_one_go_on_from_the_widths_kept(tmp_path):
    from lockstep.kernels.proof_steps import between_steps

    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    assert prove_batched_sampling(VOCAB, mx.float32, 3, proof_cache=proofs).rows == 3
    wider = prove_batched_sampling(VOCAB, mx.float32, 5, proof_cache=proofs)
    assert (wider.rows, wider.cached, wider.resumed) == (5, False, 3)

    class Stop(Exception):
        pass

    steps = []

    def stop_after_two_widths():
        steps.append(None)
        if len(steps) == 3:  # the rows alone, widths 6 and 7
            raise Stop

    with pytest.raises(Stop), between_steps(stop_after_two_widths):
        prove_batched_sampling(VOCAB, mx.float32, 10, proof_cache=proofs)
    restart = prove_batched_sampling(VOCAB, mx.float32, 10, proof_cache=proofs)
    assert (restart.rows, restart.cached, restart.resumed) == (10, False, 7)


def test_a_batch_that_raises_ends_the_proof_there_and_is_not_kept(tmp_path, monkeypatch):
    real = sampling.sample_pending

    def fails_from_three_rows(logits, positions, params, model_logits=None, seeds=None):
        if logits.shape[0] >= 3:
            raise RuntimeError("no kernel for this width")
        return real(logits, positions, params, model_logits, seeds)

    monkeypatch.setattr(sampling, "sample_pending", fails_from_three_rows)
    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert proof.rows == 2 and "no kernel for this width" in proof.reason
    again = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert (again.rows, again.cached, again.resumed) == (2, False, 2)  # width 3 tried again


# ----------------------------------------------------------------- the gate in a pass

SEEDED = SamplingParams(temperature=0.9, top_k=50, top_logprobs=2)
ROWS = 7


def states(sampling_rows: int, determinism):
    """ROWS one-row requests of one sampling group, each its own seed and position, under a
    deployment whose batched-sampling proof gave `sampling_rows`."""
    from lockstep.server.engine.decoding.request_state import RequestState
    from lockstep.server.engine.generate import GenerationRequest
    from lockstep.server.engine.guarantee.decode_plan import DecodePlan
    from tests.deterministic_fixtures import TinyLoaded
    from tests.tiny_models import tiny_llama

    loaded = TinyLoaded(tiny_llama(seed=3))
    guarantee = Guarantee(4, proven=True, shared_passes=True, pass_rows=ROWS, sampling_rows=sampling_rows)
    deployment = Deployment(guarantee=guarantee)
    out = []
    for i in range(ROWS):
        request = GenerationRequest(prompt_tokens=list(range(3, 8 + 3 * i)), max_tokens=2,
                                    sampling=replace(SEEDED, seed=100 + i))
        out.append(RequestState(loaded, request, plan=DecodePlan(determinism, "none", 0), deployment=deployment))
    return out


def sampled_in_a_pass(members):
    logits = (mx.random.normal((ROWS, VOCAB), key=mx.random.key(5)) * 3).astype(mx.float32)
    pending = presample_pass([(state, [0]) for state in members], logits, [(i, i + 1) for i in range(ROWS)])
    mx.eval([x for p in pending for x in p.arrays])
    alone = [sample_pending(logits[i:i + 1], [len(state.prompt)], state.source.params).result()[0]
             for i, state in enumerate(members)]
    widths = [p.batch.tokens.shape[0] if hasattr(p, "batch") else 1 for p in pending]
    return [bits(p.result()[0]) for p in pending], [bits(a) for a in alone], widths


def test_deterministic_rows_sample_in_blocks_of_the_proven_width_with_their_bits_alone(varying):
    from lockstep.server.engine.guarantee.decode_plan import Determinism

    proven = prove_batched_sampling(VOCAB, mx.float32, ROWS).rows
    assert proven == VARIES_FROM - 1
    got, alone, widths = sampled_in_a_pass(states(proven, Determinism.SHARED))
    assert got == alone
    assert max(widths) == proven and len(set(widths)) > 1  # blocks of 4 and 3, not one batch, not alone


def test_negative_control_a_width_the_proof_did_not_give_changes_a_deterministic_rows_bits(varying):
    from lockstep.server.engine.guarantee.decode_plan import Determinism

    got, alone, widths = sampled_in_a_pass(states(ROWS, Determinism.SHARED))
    assert widths == [ROWS] * ROWS and got != alone


def test_plain_rows_batch_at_any_width_and_deterministic_ones_alone_until_the_proof_ran():
    from lockstep.server.engine.guarantee.decode_plan import Determinism

    plain = states(0, Determinism.NONE)
    assert all(state.row_sampling() is not None and state.row_sampling().batch_rows == 0 for state in plain)
    _, _, widths = sampled_in_a_pass(plain)
    assert widths == [ROWS] * ROWS
    unproven = states(0, Determinism.SHARED)
    assert all(state.row_sampling() is None for state in unproven)
    got, alone, widths = sampled_in_a_pass(unproven)
    assert got == alone and widths == [1] * ROWS


# ----------------------------------------------------------------- startup work and /health

def test_the_engine_proves_it_at_startup_and_health_says_the_width():
    """`SamplingWork` as `serve` runs it on the engine thread: the guarantee's `sampling_rows`
    becomes the proven width, for the widest pass deterministic rows share; /health says it."""
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.phases import Phases
    from lockstep.server.startup_work import SamplingWork
    from tests.deterministic_fixtures import TinyLoaded
    from tests.http_server import running, wait_until
    from tests.tiny_models import tiny_llama

    loaded = TinyLoaded(tiny_llama(seed=3))
    guarantee = Guarantee(4, proven=True, shared_passes=True, pass_rows=6)
    runtime = types.SimpleNamespace(deployment=Deployment(guarantee=guarantee), logits_format=(VOCAB, mx.float32),
                                    timings=Phases())
    work = SamplingWork(runtime, proofs=None)
    engine = Engine(loaded, deployment=runtime.deployment)
    assert engine.describe()["deterministic_sampling_rows"] == 0  # until the proof has run
    engine.start([work])
    try:
        wait_until(lambda: not engine.starting, what="the startup work")
        with running(create_app(engine)) as url:
            health = httpx.get(url + "/health").json()
        assert health["deterministic_sampling_rows"] == 6 and engine.deployment.guarantee.sampling_rows == 6
        assert work.proof.rows == 6 and "sampling_proof" in runtime.timings
    finally:
        engine.stop()


def test_nothing_is_proven_where_deterministic_rows_never_share_a_pass():
    from lockstep.server.phases import Phases
    from lockstep.server.startup_work import SamplingWork

    runtime = types.SimpleNamespace(deployment=Deployment(guarantee=Guarantee(4, proven=True)),
                                    logits_format=(VOCAB, mx.float32), timings=Phases())
    work = SamplingWork(runtime, proofs=None)
    assert work.run().guarantee.sampling_rows == 0 and work.proof is None and "sampling_proof" not in runtime.timings
