"""The batched-sampling proof (server/engine/decoding/sampling_proof.py) and its gate: on this
backend batches of the widths the engine runs (the powers of two up to W, and W) give every row
its bits alone and the proof credits those widths, comparing no other; a sampler whose batches
change a row's bits from 5 rows on (tests/doubles/width_variant_sampler.py) is proven for 2 and
4 only, and deterministic rows then sample in blocks of 4, 2 and 1, each row's bits its own
alone, while the same sampler with a width the proof did not give changes a deterministic row's
bits (the negative control). A spy on the engine's sampling sees only proven widths, for
groups of 13 and 29 rows. Until the proof ran, deterministic rows sample alone; plain rows
batch at any width. Once it has, requests admitted before it join its blocks, and no pass is
traced again for it."""
import struct
import types
from dataclasses import replace

import httpx2 as httpx
import mlx.core as mx
import pytest

from lockstep.kernels.invariance.selftest import ProofCache
from lockstep.kernels.verdict_cache import VerdictCache
from lockstep.server.engine.decoding import sampling, token_steps
from lockstep.server.engine.decoding.sampling import SamplingParams, sample_pending
from lockstep.server.engine.decoding.sampling_proof import FORMS, proof_key, prove_batched_sampling
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
def test_the_proof_passes_here_and_compares_exactly_the_widths_the_engine_runs(dtype, monkeypatch):
    sampled = spy_on_widths(monkeypatch)
    proof = prove_batched_sampling(VOCAB, dtype, WIDEST)
    assert proof.rows == WIDEST and not proof.cached, proof.reason
    assert proof.widths == [2, 4, WIDEST] and "widths 2, 4, 7" in proof.reason
    # each row alone (once per form), then one batch a width and form: no width 3, 5 or 6
    assert sorted(set(sampled)) == [1, 2, 4, WIDEST] and sampled.count(1) == WIDEST * len(FORMS)
    assert prove_batched_sampling(VOCAB, dtype, 16).widths == [2, 4, 8, 16]


def test_a_sampler_that_varies_from_a_width_is_proven_for_the_widths_below_it(varying):
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST)
    assert proof.rows == VARIES_FROM - 1 and proof.widths == [2, 4], proof.reason
    assert f"batch of {WIDEST} rows differs" in proof.reason  # the first width compared from 5 on
    wider = prove_batched_sampling(VOCAB, mx.float32, 16)
    assert wider.rows == 4 and "batch of 8 rows differs" in wider.reason, wider.reason


def test_a_sampler_that_varies_at_two_rows_is_proven_for_none(monkeypatch):
    monkeypatch.setattr(sampling, "sample_pending", width_variant_sampler(2))
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST)
    assert proof.rows == 0 and "batch of 2 rows differs" in proof.reason


def test_a_key_mix_up_shows(monkeypatch):
    """A batch that keys every row on its first row's seed: rows 0 and 1 share a seed (their
    positions differ), so a batch of 2 is right; from 3 rows on a row with a seed of its own
    gets another's, and the proof credits 2 (a batch of 4 differs)."""
    real = sampling.sample_pending

    def first_seed_for_all(logits, positions, params, model_logits=None, seeds=None):
        return real(logits, positions, params, model_logits, None if seeds is None else [seeds[0]] * len(seeds))

    monkeypatch.setattr(sampling, "sample_pending", first_seed_for_all)
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST)
    assert proof.rows == 2 and "batch of 4 rows differs" in proof.reason, proof.reason


def test_the_verdict_is_kept_per_machine_and_never_meets_a_double(tmp_path, monkeypatch):
    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    first = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    again = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert (first.rows, first.cached, again.rows, again.cached) == (WIDEST, False, WIDEST, True)
    narrower = prove_batched_sampling(VOCAB, mx.float32, 4, proof_cache=proofs)
    assert (narrower.rows, narrower.cached) == (4, True)
    odd = prove_batched_sampling(VOCAB, mx.float32, 3, proof_cache=proofs)  # width 3 was never compared
    assert (odd.rows, odd.cached, odd.resumed) == (3, False, 2)
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
    assert (kept.rows, kept.cached) == (VARIES_FROM - 1, True)  # no width from the one that differed on


def test_a_record_of_every_width_from_before_is_not_read_as_the_widths_proven(tmp_path):
    """The record the proof kept when it compared every width 2..n ("proven_through"): its key
    differs, and were one under this key it would credit nothing."""
    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    key = proof_key(VOCAB, mx.float32)
    assert key["rows"] == "powers of two and the widest"
    proofs.store.put(key, {"proven_through": WIDEST, "differs_at": 0, "reason": ""})
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert (proof.rows, proof.cached, proof.resumed) == (WIDEST, False, 0)


def test_a_wider_proof_and_a_stopped_one_go_on_from_the_widths_kept(tmp_path):
    from lockstep.kernels.proof_steps import between_steps

    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    assert prove_batched_sampling(VOCAB, mx.float32, 4, proof_cache=proofs).rows == 4
    wider = prove_batched_sampling(VOCAB, mx.float32, 6, proof_cache=proofs)
    assert (wider.rows, wider.cached, wider.resumed) == (6, False, 4)

    class Stop(Exception):
        pass

    steps = []

    def stop_after_one_width():
        steps.append(None)
        if len(steps) == 2:  # the rows alone, width 8
            raise Stop

    with pytest.raises(Stop), between_steps(stop_after_one_width):
        prove_batched_sampling(VOCAB, mx.float32, 16, proof_cache=proofs)
    restart = prove_batched_sampling(VOCAB, mx.float32, 16, proof_cache=proofs)
    assert (restart.rows, restart.cached, restart.resumed) == (16, False, 8)


def test_a_batch_that_raises_ends_the_proof_there_and_is_not_kept(tmp_path, monkeypatch):
    real = sampling.sample_pending

    def fails_from_three_rows(logits, positions, params, model_logits=None, seeds=None):
        if logits.shape[0] >= 3:
            raise RuntimeError("no kernel for this width")
        return real(logits, positions, params, model_logits, seeds)

    monkeypatch.setattr(sampling, "sample_pending", fails_from_three_rows)
    proofs = ProofCache(VerdictCache("selftest", root=tmp_path), model_identity={})
    proof = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert proof.rows == 2 and "no kernel for this width" in proof.reason and "at width 4" in proof.reason
    again = prove_batched_sampling(VOCAB, mx.float32, WIDEST, proof_cache=proofs)
    assert (again.rows, again.cached, again.resumed) == (2, False, 2)  # width 3 tried again


# ----------------------------------------------------------------- the gate in a pass

SEEDED = SamplingParams(temperature=0.9, top_k=50, top_logprobs=2)
ROWS = 7


def spy_on_widths(monkeypatch) -> list[int]:
    """The rows of every sampling built from now on (a batch's width, or 1: a row alone), in
    order: the sampler a batch calls and the one a row alone calls, each still the one in force."""
    seen = []

    def spy(module):
        inner = module.sample_pending

        def sample_pending(logits, *args, **kwargs):
            seen.append(logits.shape[0])
            return inner(logits, *args, **kwargs)

        monkeypatch.setattr(module, "sample_pending", sample_pending)

    spy(sampling)
    spy(token_steps)
    return seen


def states(sampling_rows: int, determinism, rows: int = ROWS):
    """`rows` one-row requests of one sampling group, each its own seed and position, under a
    deployment whose batched-sampling proof gave `sampling_rows`."""
    from lockstep.server.engine.decoding.request_state import RequestState
    from lockstep.server.engine.generate import GenerationRequest
    from lockstep.server.engine.guarantee.decode_plan import DecodePlan
    from tests.deterministic_fixtures import TinyLoaded
    from tests.tiny_models import tiny_llama

    loaded = TinyLoaded(tiny_llama(seed=3))
    guarantee = Guarantee(4, proven=True, shared_passes=True, pass_rows=rows, sampling_rows=sampling_rows)
    deployment = Deployment(guarantee=guarantee)
    out = []
    for i in range(rows):
        request = GenerationRequest(prompt_tokens=list(range(3, 8 + 3 * i)), max_tokens=2,
                                    sampling=replace(SEEDED, seed=100 + i))
        out.append(RequestState(loaded, request, plan=DecodePlan(determinism, "none", 0), deployment=deployment))
    return out


def sampled_in_a_pass(members):
    rows = len(members)
    logits = (mx.random.normal((rows, VOCAB), key=mx.random.key(5)) * 3).astype(mx.float32)
    pending = presample_pass([(state, [0]) for state in members], logits, [(i, i + 1) for i in range(rows)])
    mx.eval([x for p in pending for x in p.arrays])
    alone = [sample_pending(logits[i:i + 1], [len(state.prompt)], state.source.params).result()[0]
             for i, state in enumerate(members)]
    widths = [p.batch.tokens.shape[0] if hasattr(p, "batch") else 1 for p in pending]
    return [bits(p.result()[0]) for p in pending], [bits(a) for a in alone], widths


def test_deterministic_rows_sample_in_blocks_of_the_proven_widths_with_their_bits_alone(varying):
    from lockstep.server.engine.guarantee.decode_plan import Determinism

    proven = prove_batched_sampling(VOCAB, mx.float32, ROWS).rows
    assert proven == VARIES_FROM - 1
    got, alone, widths = sampled_in_a_pass(states(proven, Determinism.SHARED))
    assert got == alone
    assert widths == [4] * 4 + [2] * 2 + [1]  # in row order, largest first: not one batch, not alone


@pytest.mark.parametrize("rows, sampler, blocks", [
    (13, "real", [8, 4, 1]), (29, "real", [16, 8, 4, 1]),
    (13, "varies from 5", [4, 4, 4, 1]), (29, "varies from 5", [4] * 7 + [1]),
    (31, "real", [16, 8, 4, 2, 1]), (31, "varies from 5", [4] * 7 + [2, 1]),  # a remainder of 3
])
def test_the_engine_runs_no_batch_of_a_width_the_proof_did_not_compare(rows, sampler, blocks, monkeypatch):
    """A group of `rows` deterministic rows under the proof of the widest pass (32): every
    sampling the pass builds (seen by a spy) has a width the proof proved, or 1 (alone); the
    blocks take the rows largest first, and every row's bits are its own alone."""
    from lockstep.server.engine.guarantee.decode_plan import Determinism

    if sampler != "real":
        monkeypatch.setattr(sampling, "sample_pending", width_variant_sampler(VARIES_FROM))
    proof = prove_batched_sampling(VOCAB, mx.float32, 32)
    assert proof.rows == (32 if sampler == "real" else 4), proof.reason
    members = states(proof.rows, Determinism.SHARED, rows)
    built = spy_on_widths(monkeypatch)  # the rows alone to compare with are sampled past it
    got, alone, _ = sampled_in_a_pass(members)
    assert set(built) <= {1, *proof.widths}, built
    assert built == blocks
    assert got == alone


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


@pytest.mark.parametrize("change", ["sampling_rows", "pass_rows", "none"])
def test_the_proof_reaches_requests_admitted_before_it_and_retraces_no_pass(change):
    """`SamplingWork` installs a deployment that differs in `sampling_rows` alone: deterministic
    requests already admitted sample in its blocks from then on, and the compiled passes and
    the pass decoded ahead are kept. Any other change (the control: a wider pass), and a
    deployment installed unchanged (startup work may have patched the model in place), retrace
    them and leave the admitted requests' deployments as they were."""
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.decode_plan import Determinism
    from lockstep.server.engine.scheduling.scheduler import Slot
    from tests.deterministic_fixtures import TinyLoaded
    from tests.tiny_models import tiny_llama

    admitted = states(0, Determinism.SHARED, rows=3)
    before = admitted[0].deployment
    engine = Engine(TinyLoaded(tiny_llama(seed=3)), deployment=before)
    engine.scheduler.active = [Slot(None, state, 0) for state in admitted]
    dropped = []
    engine.runner.compiled = types.SimpleNamespace(forget=lambda: dropped.append("traces"))
    engine.runner._drop_ahead = lambda: dropped.append("ahead")
    assert all(state.row_sampling() is None for state in admitted)  # alone until the proof ran
    guarantee = {"sampling_rows": replace(before.guarantee, sampling_rows=ROWS),
                 "pass_rows": replace(before.guarantee, pass_rows=ROWS + 1), "none": before.guarantee}[change]
    engine.set_deployment(replace(before, guarantee=guarantee))
    if change == "sampling_rows":
        assert dropped == [] and [state.row_sampling().batch_rows for state in admitted] == [ROWS] * 3
        got, alone, widths = sampled_in_a_pass(admitted)
        assert got == alone and widths == [2, 2, 1]
    else:
        assert dropped == ["ahead", "traces"] and all(state.row_sampling() is None for state in admitted)
    assert engine.scheduler.deployment is engine.runner.deployment is engine.deployment


def test_nothing_is_proven_where_deterministic_rows_never_share_a_pass():
    from lockstep.server.phases import Phases
    from lockstep.server.startup_work import SamplingWork

    runtime = types.SimpleNamespace(deployment=Deployment(guarantee=Guarantee(4, proven=True)),
                                    logits_format=(VOCAB, mx.float32), timings=Phases())
    work = SamplingWork(runtime, proofs=None)
    assert work.run().guarantee.sampling_rows == 0 and work.proof is None and "sampling_proof" not in runtime.timings
