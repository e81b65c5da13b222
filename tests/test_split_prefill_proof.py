"""kernels/batching/split_prefill_proof.py: a deterministic prompt may be cut anywhere into
chunks of at least `shared_chunk_rows(L)` rows where every layer's KV is then the same as one
call's, bit for bit.

The reference BLAS keeps a row's bits whatever the call's width and wherever its chunk
starts, so the proof passes there, the deployment's guarantee carries the rows, and a
deterministic request's prefix-cache hit then resumes where it ends (16 rows before the
prompt's end at the latest), its answer bitwise its cold run's. OpenBLAS (this CPU's default:
a GEMM's bits depend on its shape) and the shape-variant double (a GEMM whose rows change
between calls of up to 32 rows and wider ones, as GPU tiles may, or attention split over the
keys a call holds) make the proof fail, and resuming there without it changes the answer: the
negative controls.
"""
from contextlib import nullcontext
from dataclasses import replace

import pytest

from lockstep.kernels.batching.ragged import enable_ragged
from lockstep.kernels.batching.shared_prefill_proof import MIN_SHARED_CHUNK
from lockstep.kernels.batching.split_prefill_proof import cuts, prove_prefill_splits, sweep
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.server.engine.guarantee.deployment import Deployment, proven_deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from tests.deterministic_fixtures import GREEDY, TinyLoaded, run_generate
from tests.doubles.shape_variant import shape_variant_backend
from tests.test_prefix_cache import LONG, SHARES_40, TOKENS, WIDE, cold_and_cached, plans, prompt_calls, same_run
from tiny_models import tiny_llama

L = 4
WIDTH = 64


def installed(**double):
    """The tiny model with L installed and ragged passes enabled, inside the double if given."""
    model = tiny_llama()
    if double:
        with shape_variant_backend(**double):
            set_batch_invariant_limit(model, L)
    else:
        set_batch_invariant_limit(model, L)
    enable_ragged(model)
    return model


@pytest.fixture(scope="module")
def model():
    return installed()


@pytest.mark.parametrize("width", [16, 31, 32, 48, 64, 128, 512])
def test_every_cut_leaves_pieces_of_the_proven_rows(width):
    plan = cuts(width, MIN_SHARED_CHUNK)
    assert bool(plan) == (width >= 2 * MIN_SHARED_CHUNK)
    for points in plan:
        pieces = [b - a for a, b in zip((0, *points), (*points, width))]
        assert min(pieces) >= MIN_SHARED_CHUNK and sum(pieces) == width
    if width >= 64:  # a narrowest first and last piece, and cuts off the chunk's grid
        assert (MIN_SHARED_CHUNK, width - MIN_SHARED_CHUNK) in plan and len(plan) == 3


@pytest.mark.reference_blas
def test_the_proof_passes_on_the_reference_blas(model):
    proof = prove_prefill_splits(model, L, WIDTH)
    assert proof, proof.reason


@pytest.mark.reference_blas
def test_every_cut_is_compared(model, monkeypatch):
    """A prefill that changes one bit only where a piece starts at 35 (the last cut's third
    piece) fails the proof."""
    import lockstep.kernels.batching.split_prefill_proof as proof_module

    original = proof_module.call_without_head

    def changing_one_cut(m, inputs, cache):
        start = cache[0].offset
        out = original(m, inputs, cache)
        if start == 2 * MIN_SHARED_CHUNK + 3:
            cache[0].keys[..., start, :1] = cache[0].keys[..., start, :1] * 1.5
        return out

    assert cuts(WIDTH, MIN_SHARED_CHUNK)[-1] == (MIN_SHARED_CHUNK + 1, 2 * MIN_SHARED_CHUNK + 3)
    monkeypatch.setattr(proof_module, "call_without_head", changing_one_cut)
    proof = prove_prefill_splits(model, L, WIDTH)
    assert not proof and "cut at 17, 35" in proof.reason


@pytest.mark.reference_blas
def test_a_width_the_cuts_miss_is_swept(model, monkeypatch):
    """A backend whose kernel changes a row's bits only in calls of 24 rows (none of the cuts'
    pieces) fails the proof at the sweep."""
    import lockstep.kernels.batching.split_prefill_proof as proof_module

    original = proof_module.call_without_head

    def changing_24_rows(m, inputs, cache):
        out = original(m, inputs, cache)
        if inputs.shape[-1] == 24:
            cache[0].keys[..., :1, :1] = cache[0].keys[..., :1, :1] * 1.5
        return out

    assert 24 in sweep(WIDTH, MIN_SHARED_CHUNK)
    assert all(24 not in (b - a for a, b in zip((0, *p), (*p, WIDTH))) for p in cuts(WIDTH, MIN_SHARED_CHUNK))
    monkeypatch.setattr(proof_module, "call_without_head", changing_24_rows)
    proof = prove_prefill_splits(model, L, WIDTH)
    assert not proof and "first 24 tokens alone" in proof.reason


@pytest.mark.parametrize("width", [32, 64, 128, 512])
def test_the_sweep_takes_the_widths_around_every_power_of_two(width):
    widths = sweep(width, MIN_SHARED_CHUNK)
    assert widths == sorted(set(widths)) and widths[0] == MIN_SHARED_CHUNK and widths[-1] < width
    powers = [p for p in (16, 32, 64, 128, 256, 512) if p <= width]
    assert {w for p in powers for w in (p - 1, p, p + 1, p + p // 2) if 16 <= w < width} <= set(widths)
    assert sweep(512, 16) == [16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 192, 255, 256, 257, 384, 511]
    assert sweep(128, 21)[:3] == [21, 22, 24]  # the narrowest chunk at L = 20 and one more


def test_the_proof_fails_on_openblas(model):
    proof = prove_prefill_splits(model, L, WIDTH)
    assert not proof and "cut at" in proof.reason


@pytest.mark.parametrize("double", [dict(dense_rows=32), dict(dense_rows=1)], ids=["narrow and wide GEMMs",
                                                                                   "attention split over keys"])
def test_the_proof_fails_where_a_cut_changes_a_rows_bits(double):
    with shape_variant_backend(**double):
        proof = prove_prefill_splits(installed(**double), L, WIDTH)
    assert not proof and "cut at" in proof.reason


@pytest.mark.reference_blas
def test_the_guarantee_carries_the_rows_where_proven(model):
    assert proven_deployment(model, set_batch_invariant_limit(model, L),
                             prefill_chunk=WIDTH).guarantee.prefill_split_rows == MIN_SHARED_CHUNK
    # no room for two chunks of 16 rows in a chunk of 31: not even tried
    assert proven_deployment(model, set_batch_invariant_limit(model, L),
                             prefill_chunk=31).guarantee.prefill_split_rows == 0


def test_the_guarantee_carries_no_rows_where_the_proof_fails():
    """Under a double whose multi-row GEMMs all reduce alike (chunks keep their rows in shared
    passes: that proof passes) but whose attention splits over the keys a call holds, the split
    proof fails and the guarantee carries no rows."""
    double = dict(dense_rows=1)
    other = installed(**double)
    with shape_variant_backend(**double):
        guarantee = proven_deployment(other, set_batch_invariant_limit(other, L), prefill_chunk=WIDTH).guarantee
    assert guarantee.shared_prefill_rows == MIN_SHARED_CHUNK and guarantee.prefill_split_rows == 0


@pytest.fixture(scope="module")
def tiny():
    return TinyLoaded(tiny_llama(seed=3))


def split_deployment(tiny) -> Deployment:
    """L = 4 installed and proven (inside the double, so a canonical strategy is), with a
    prompt claimed to be cuttable anywhere into chunks of 16 rows, whatever this backend."""
    with shape_variant_backend():
        installed = set_batch_invariant_limit(tiny.model, L)
    return Deployment(guarantee=replace(Guarantee.installed(installed), prefill_split_rows=MIN_SHARED_CHUNK),
                      prefill_chunk=WIDE)


SHARES_50 = LONG[:50] + [(7 * i + 1) % 256 for i in range(10)]


@pytest.mark.parametrize("backend", [pytest.param("reference BLAS", marks=pytest.mark.reference_blas),
                                     "OpenBLAS", "double"])
def test_a_deterministic_hit_resumes_where_it_ends_and_keeps_its_cold_bits_where_cuts_keep_them(
        tiny, monkeypatch, backend):
    """With the rows proven, a deterministic cold prompt of 59 tokens runs as one chunk (no
    narrow ones), a hit of 40 tokens resumes at 40 and one of 50 at 43 (16 rows left), and a
    plain request's whole chunks are a deterministic one's start: every answer its cold run's,
    on the reference BLAS (where the proof passes). Negative controls: the same claimed on
    OpenBLAS or under the double (where the proof fails) changes answers."""
    deployment = split_deployment(tiny)
    assert prove_prefill_splits(tiny.model, L, WIDE).passed == (backend == "reference BLAS")
    det, plain = plans(deployment)
    calls = prompt_calls(monkeypatch)
    with shape_variant_backend(dense_rows=32) if backend == "double" else nullcontext():
        cold = run_generate(tiny, LONG, TOKENS, GREEDY, plan=det, deployment=deployment)
        assert calls == [(0, 59)]
        outcomes = []
        for warm_with, warm_plan, start in ((SHARES_40, det, (40, 19)), (SHARES_50, det, (43, 16)),
                                            (SHARES_40, plain, (40, 19))):
            _, cached, pc = cold_and_cached(tiny, LONG, GREEDY, warm_with, deployment=deployment, plan=det,
                                            warm_plan=warm_plan, calls=calls)
            assert pc.hits == 1 and calls[0] == start
            outcomes.append(same_run(cold, cached))
    assert outcomes == [backend == "reference BLAS"] * 3
