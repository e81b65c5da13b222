"""Speculative decoding == plain decoding, bit for bit, only where batch invariance covers
the verification width: on the shape-variant double (tests/doubles/shape_variant.py), the CPU
stand-in for a backend whose reductions change with the number of rows M.

Driven through server.engine.generate.generate() with real DecodePlans and Deployments, and at the
token_steps level (Step.logits rows). Tiny random llamas keep it fast; the draft model is a
4-bit quantized copy of the target, so it agrees often but not always.
"""
import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.doubles.shape_variant import shape_variant_backend
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.kernels.invariance.selftest import bits_equal
from lockstep.server.engine.guarantee.decode_plan import DecodePlan, plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.decoding.drafters import DraftModelDrafter, PromptLookupDrafter
from tests.deterministic_fixtures import (GREEDY, SEEDED, TinyLoaded, chosen_rows, rows_bit_identical,
                                          run_generate, steps_from)
from tests.tiny_models import QUANT_MODES, tiny_llama

LIMIT = 6
TOKENS = 24
# Repetitive, so prompt lookup always has something to propose.
PROMPT = [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12]
SAMPLINGS = {"greedy": GREEDY, "seeded": SEEDED}


HEAD_SCALE = 8.0  # sharper next-token distributions, so seeded sampling often agrees with a greedy draft


def peaked_llama(quant=None):
    model = tiny_llama(seed=5)
    model.lm_head.weight = model.lm_head.weight * HEAD_SCALE
    if quant:
        group_size, bits = QUANT_MODES[quant]
        nn.quantize(model, group_size=group_size, bits=bits, mode=quant)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tiny():
    return TinyLoaded(peaked_llama())


@pytest.fixture(scope="module")
def draft():
    return peaked_llama(quant="affine")  # the target's weights, 4-bit


@pytest.fixture
def limit(tiny):
    """Install L (inside the double, so the self-test must prove a canonical strategy);
    the native model again afterwards."""
    def install(value):
        with shape_variant_backend():
            invariance = set_batch_invariant_limit(tiny.model, value)
        if value:
            assert invariance.guaranteed, invariance.reason
            assert invariance.strategy != "native"  # native cannot pass under the double
        return invariance

    yield install
    set_batch_invariant_limit(tiny.model, 0)


def deployment_for(invariance, draft, limit):
    return Deployment(guarantee=Guarantee.installed(invariance) if invariance else Guarantee(limit), draft_model=draft,
                      prefill_chunk=8)


def same_bits(a, b) -> bool:
    return (a.tokens == b.tokens and a.logprob_bits() == b.logprob_bits()
            and a.top_bits() == b.top_bits() and rows_bit_identical(chosen_rows(a), chosen_rows(b)))


# ------------------------------------------------------------------ through generate()

@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_speculative_equals_plain_bitwise_with_the_limit(tiny, draft, limit, sampling):
    invariance = limit(LIMIT)
    dep = deployment_for(invariance, draft, LIMIT)
    params = SAMPLINGS[sampling]
    with shape_variant_backend():
        plain_plan = plan_request(dep, deterministic=True, speculative="none", num_draft_tokens=None)
        plain = run_generate(tiny, PROMPT, TOKENS, params, plan=plain_plan, deployment=dep)
        runs = {}
        for method in ("draft", "prompt_lookup"):
            for k in (1, 3, LIMIT - 1):
                p = plan_request(dep, deterministic=True, speculative=method, num_draft_tokens=k)
                assert (p.method, p.num_draft_tokens, p.determinism) == (method, k, "alone")
                runs[method, k] = run_generate(tiny, PROMPT, TOKENS, params, plan=p, deployment=dep)

    assert len(plain.tokens) == TOKENS and plain.extension["forward_passes"] == TOKENS
    assert plain.extension["guaranteed"] is True
    for (method, k), run in runs.items():
        assert same_bits(run, plain), (method, k)
        assert run.text == plain.text
        ext = run.extension
        assert (ext["speculative"], ext["num_draft_tokens"]) == (method, k)
        assert ext["drafted_tokens"] > 0 and ext["forward_passes"] <= TOKENS
    # speculation really happened: drafts were accepted (fewer passes) and rejected (rewinds)
    assert any(r.extension["accepted_tokens"] > 0 for r in runs.values())
    assert any(r.extension["accepted_tokens"] < r.extension["drafted_tokens"] for r in runs.values())
    assert min(r.extension["forward_passes"] for r in runs.values()) < TOKENS


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_speculative_differs_from_plain_without_the_limit(tiny, draft, sampling):
    """Negative control: the native model (L = 0) under the double. Verification rows come
    from (k + 1)-row calls, so their logits (and logprobs) are not plain decoding's bits."""
    dep = deployment_for(None, draft, 0)
    params = SAMPLINGS[sampling]
    with shape_variant_backend():
        plain = run_generate(tiny, PROMPT, TOKENS, params, plan=None, deployment=dep)
        for method in ("draft", "prompt_lookup"):
            # speculation on an L = 0 deployment is only available without `deterministic`
            p = plan_request(dep, deterministic=False, speculative=method, num_draft_tokens=3)
            assert p.method == method
            spec = run_generate(tiny, PROMPT, TOKENS, params, plan=p, deployment=dep)
            assert spec.extension["drafted_tokens"] > 0
            assert not rows_bit_identical(chosen_rows(spec), chosen_rows(plain)), method
            assert spec.logprob_bits() != plain.logprob_bits(), method
        again = run_generate(tiny, PROMPT, TOKENS, params, plan=None, deployment=dep)
    assert same_bits(again, plain)  # control: plain decoding repeats itself exactly


def test_the_limit_must_cover_the_verification_width(tiny, draft, limit):
    """k = L - 1 (L rows) is exact; k = L (L + 1 rows, past the limit: native kernels) is
    not. plan_request refuses the latter for deterministic requests; built by hand here."""
    small = 4
    invariance = limit(small)
    dep = deployment_for(invariance, draft, small)
    with shape_variant_backend():
        plain = run_generate(tiny, PROMPT, TOKENS, GREEDY, plan=None, deployment=dep)
        inside = run_generate(tiny, PROMPT, TOKENS, GREEDY, deployment=dep,
                              plan=DecodePlan("shared", "draft", small - 1, guaranteed=True))
        outside = run_generate(tiny, PROMPT, TOKENS, GREEDY, deployment=dep,
                               plan=DecodePlan("shared", "draft", small, guaranteed=True))
    assert same_bits(inside, plain)
    assert not rows_bit_identical(chosen_rows(outside), chosen_rows(plain))


def test_deterministic_on_an_l0_deployment_runs_plain_and_says_so(tiny, draft):
    dep = deployment_for(None, draft, 0)
    with shape_variant_backend():
        plain = run_generate(tiny, PROMPT, TOKENS, SEEDED, plan=None, deployment=dep)
        p = plan_request(dep, deterministic=True, speculative="draft", num_draft_tokens=5)
        run = run_generate(tiny, PROMPT, TOKENS, SEEDED, plan=p, deployment=dep)
    assert p.determinism == "alone" and p.method == "none"
    assert same_bits(run, plain)
    ext = run.extension
    assert (ext["speculative"], ext["num_draft_tokens"], ext["guaranteed"]) == ("none", 0, False)
    assert ext["batch_invariant_limit"] == 0 and "note" in ext
    assert (ext["drafted_tokens"], ext["accepted_tokens"], ext["forward_passes"]) == (0, 0, TOKENS)


# ------------------------------------------------------------------ token_steps: Step.logits

def drafters(draft):
    return {"draft": lambda: DraftModelDrafter(draft), "prompt_lookup": lambda: PromptLookupDrafter()}


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
def test_step_logits_rows_are_bit_identical_only_with_the_limit(tiny, draft, limit, method):
    make = drafters(draft)[method]
    n, k = 16, 3
    with shape_variant_backend():
        native_plain, _ = steps_from(tiny.model, PROMPT, n, SEEDED)
        native_spec, native_stats = steps_from(tiny.model, PROMPT, n, SEEDED, drafter=make(), k=k)
    limit(LIMIT)
    with shape_variant_backend():
        plain, _ = steps_from(tiny.model, PROMPT, n, SEEDED)
        spec, stats = steps_from(tiny.model, PROMPT, n, SEEDED, drafter=make(), k=k)

    assert stats.drafted > 0 and native_stats.drafted > 0
    assert [s.sampled for s in spec] == [s.sampled for s in plain]  # token, logprob, top: exact
    assert all(bits_equal(a.logits, b.logits) for a, b in zip(spec, plain))
    # under L = 0 at least one verified row carries different bits
    assert not all(bits_equal(a.logits, b.logits) for a, b in zip(native_spec, native_plain))
    # the canonical forms change no bits of the single-row path: plain == native plain
    assert all(bits_equal(a.logits, b.logits) for a, b in zip(plain, native_plain))


# ------------------------------------------------------------------ the embedded model itself

def test_embedded_model_speculation_is_exact_only_with_the_limit(embedded_model):
    """The real SmolLM2 (quantized linears, tied quantized head) under the double, with its
    quantized matmuls varying from 2 rows up: prompt lookup with k = 2 (3-row verification)
    against plain decoding, at L = 0 (must differ) and at L = 3 (must match bitwise)."""
    loaded = embedded_model
    prompt = list(loaded.tokenizer.encode("hello hello hello hello hello hello"))
    n = 12

    def runs(dep):
        plain = run_generate(loaded, prompt, n, GREEDY, plan=None, deployment=dep, tokenizer_ids=lambda t: [t])
        p = plan_request(dep, deterministic=dep.guarantee.guaranteed, speculative="prompt_lookup", num_draft_tokens=2)
        assert (p.method, p.num_draft_tokens) == ("prompt_lookup", 2)
        spec = run_generate(loaded, prompt, n, GREEDY, plan=p, deployment=dep, tokenizer_ids=lambda t: [t])
        assert spec.extension["accepted_tokens"] > 0
        return plain, spec

    try:
        with shape_variant_backend(quantized_rows=2):
            native_plain, native_spec = runs(Deployment())
            invariance = set_batch_invariant_limit(loaded.model, 3, prefixes=(11,))
            assert invariance.guaranteed, invariance.reason
            plain, spec = runs(Deployment(guarantee=Guarantee.installed(invariance)))
    finally:
        set_batch_invariant_limit(loaded.model, 0)  # other tests share this model

    assert len(plain.tokens) == n
    assert same_bits(spec, plain) and spec.text == plain.text
    assert not rows_bit_identical(chosen_rows(native_spec), chosen_rows(native_plain))
    assert same_bits(plain, native_plain)  # single-row decoding is untouched by the canonical forms
