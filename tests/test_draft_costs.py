"""A draft model is used only where it pays (server/engine/decoding/draft_costs.py, server/draft_assessment.py
`assess_draft`): its passes measured against the target's at startup, on a fake clock here
(the models' costs are what the fake draft charges it, no sleeps), decide whether requests
draft from it at all, what adaptive speculation weighs per proposed token, and how many of
its prompt tokens one engine step may prefill."""
import functools

import mlx.core as mx
import pytest
from openai import OpenAI

import lockstep.server.engine.decoding.draft_costs as draft_costs
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.decoding.draft_costs import (DRAFT_PREFILL_BUDGET_S, DraftCosts, drafting_refusal,
                                                         measure_draft_costs)
from lockstep.server.engine.generate import generate
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.http_server import running
from tests.test_deterministic_double import peaked_llama
from tests.test_scheduler import WidestCall, finish_order, plain

GREEDY = SamplingParams(temperature=0.0)


class FakeClock:
    """Time that passes only when told: `tick` per reading (the target's whole cost), plus
    what a `Charged` model adds per call."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class Charged:
    """A model whose every call costs `per_call + per_token * tokens` on `clock`."""

    def __init__(self, inner, clock: FakeClock, per_call: float = 0.0, per_token: float = 0.0):
        self.inner, self.clock, self.per_call, self.per_token = inner, clock, per_call, per_token

    def __call__(self, inputs, cache=None, **kw):
        self.clock.now += self.per_call + self.per_token * inputs.shape[1]
        return self.inner(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tiny():
    return TinyLoaded(peaked_llama())


def _answer(loaded, deployment, plan, prompt, n=12):
    deltas = [d for d in generate(loaded, GenerationRequest(prompt, n, GREEDY), plan=plan, deployment=deployment) if d]
    return [ord(ch) - 0x4E00 for d in deltas for ch in d.text], rendered(deltas[-1].report)


# ------------------------------------------------------------------ the measurement

def test_the_measurement_reads_each_models_pass_cost_off_the_clock(tiny):
    clock = FakeClock(tick=0.01)  # the target's pass: one tick between the two readings
    draft = Charged(peaked_llama(quant="affine"), clock, per_call=0.02, per_token=0.005)
    costs = measure_draft_costs(tiny.model, draft, context=16, clock=clock)
    assert costs.target_step_s == pytest.approx(0.01)
    assert costs.draft_step_s == pytest.approx(0.01 + 0.02 + 0.005)
    assert costs.step_cost == pytest.approx(3.5)
    # the prompt after a one-token warm-up: 15 tokens in one call
    assert costs.draft_prefill_token_s == pytest.approx((0.01 + 0.02 + 15 * 0.005) / 15)


def test_drafting_is_refused_where_even_high_acceptance_cannot_pay_for_the_drafts():
    flat = (1.0, 1.02, 1.04, 1.06, 1.08)  # verification rows nearly free: only the draft's own cost decides
    cheap = DraftCosts(target_step_s=0.010, draft_step_s=0.002, draft_prefill_token_s=0.001)
    assert drafting_refusal("d", cheap, 4, flat) == ""
    slow = DraftCosts(target_step_s=0.010, draft_step_s=0.068, draft_prefill_token_s=0.1)  # the CPU's 4-bit copy
    reason = drafting_refusal("d", slow, 4, flat)
    assert "does not pay" in reason and "6.80 target passes" in reason
    # a draft as cheap as nothing still does not pay where a verification pass costs its rows
    linear = tuple(float(w) for w in range(1, 6))
    assert drafting_refusal("d", DraftCosts(0.01, 1e-6, 1e-6), 4, linear) != ""


# ------------------------------------------------------- the deployment's decision

def _runtime(loaded, draft, clock, monkeypatch, **options):
    """A Runtime around `loaded` whose draft model is assessed on `clock`."""
    from lockstep.kernels.invariance.limit import InstalledInvariance
    from lockstep.server.draft_assessment import assess_draft
    from lockstep.server.phases import Phases
    from lockstep.server.runtime import Options, Runtime

    monkeypatch.setattr(draft_costs, "measure_draft_costs", functools.partial(measure_draft_costs, clock=clock))
    deployment = Deployment(draft_model=draft, draft_name="fake-draft", pass_costs=(1.0, 1.02, 1.04, 1.06, 1.08),
                            prefill_chunk=64)
    runtime = Runtime(loaded, deployment, None, InstalledInvariance(0, "native", "cpu", False, "off (L = 0)"),
                      "", Phases())
    runtime.deployment = assess_draft(runtime, Options(max_draft_tokens=4, **options))
    return runtime


def test_a_slow_draft_is_not_drafted_from_and_says_why_in_the_note_and_models(tiny, monkeypatch):
    """The issue: a draft model 6.8x slower per token than the target slowed every drafted
    request. Measured at startup, it is not drafted from: requests asking for it get the plain
    answer, with the reason in `lockstep.note`, and /v1/models says so."""
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine

    clock = FakeClock(tick=0.01)
    runtime = _runtime(tiny, Charged(peaked_llama(quant="affine"), clock, per_call=0.06), clock, monkeypatch)
    deployment = runtime.deployment
    assert "does not pay" in deployment.draft_refusal and deployment.draft_step_cost == pytest.approx(7.0)
    plan = plan_request(deployment, deterministic=False, speculative="draft", num_draft_tokens=3)
    assert plan.method == "none" and deployment.draft_refusal in plan.note

    engine = Engine(tiny, max_active=2, deployment=deployment).start()
    try:
        with running(create_app(engine, model_extras=runtime.model_info)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            drafted = client.completions.create(model="default", prompt=[4, 5, 6, 4, 5], max_tokens=8,
                                                temperature=0, extra_body={"speculative": "draft"})
            none = client.completions.create(model="default", prompt=[4, 5, 6, 4, 5], max_tokens=8,
                                             temperature=0, extra_body={"speculative": "none"})
            info = client.models.list().data[0].model_extra["lockstep"]
    finally:
        engine.stop()
    ext = drafted.model_extra["lockstep"]
    assert drafted.choices[0].text == none.choices[0].text
    assert ext["speculative"] == "none" and ext["drafted_tokens"] == 0 and "does not pay" in ext["note"]
    assert info["draft_model_state"] == f"not drafted from: {deployment.draft_refusal}"
    assert info["draft_costs"]["draft_step_cost"] == pytest.approx(7.0)


def test_a_cheap_draft_is_drafted_from(tiny, monkeypatch):
    clock = FakeClock(tick=0.01)
    runtime = _runtime(tiny, peaked_llama(quant="affine"), clock, monkeypatch)  # costs one tick, like the target
    cheap = runtime.deployment
    assert cheap.draft_step_cost == pytest.approx(1.0)
    # a draft costing what the target does never pays; one far cheaper does (the GPU's 4-bit copy)
    assert cheap.draft_refusal
    runtime = _runtime(tiny, Charged(peaked_llama(quant="affine"), clock, per_call=-0.009), clock, monkeypatch)
    deployment = runtime.deployment
    assert deployment.draft_refusal == "" and "draft_model_state" not in runtime.model_info()
    plan = plan_request(deployment, deterministic=False, speculative="draft", num_draft_tokens=3)
    tokens, ext = _answer(tiny, deployment, plan, [4, 5, 6, 4, 5])
    assert plan.method == "draft" and ext["drafted_tokens"] > 0
    assert tokens == _answer(tiny, deployment, plan_request(deployment, deterministic=False, speculative="none",
                                                             num_draft_tokens=None), [4, 5, 6, 4, 5])[0]


def test_default_quantized_has_no_cheap_form_on_the_cpu():
    from lockstep.server.draft_assessment import no_cheap_draft
    from lockstep.server.runtime import Options

    assert mx.default_device().type == mx.DeviceType.cpu
    assert "no draft cheaper than the target" in no_cheap_draft(Options(draft_model="default-quantized"))
    assert no_cheap_draft(Options(draft_model="/some/other/model")) == ""  # measured instead


# --------------------------------------------- adaptive speculation weighs the measured cost

class OneLayerAlias:
    """The target itself as a draft (every draft accepted) that looks one layer deep, so the
    depth estimate calls it cheap while its measured cost says otherwise."""

    layers = [None]

    def __init__(self, target):
        self.target = target

    def __call__(self, inputs, cache=None):
        return self.target(inputs, cache=cache)

    def make_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.target)


def test_adaptive_speculation_stops_drafting_where_the_measured_draft_cost_does_not_pay(tiny):
    draft = OneLayerAlias(tiny.model)
    flat = (1.0, 1.0, 1.0, 1.0, 1.0)

    def drafted(step_cost):
        deployment = Deployment(draft_model=draft, adaptive_draft_tokens=True, pass_costs=flat,
                                draft_step_cost=step_cost)
        plan = plan_request(deployment, deterministic=False, speculative="draft", num_draft_tokens=4)
        return _answer(tiny, deployment, plan, [4, 5, 6], n=48)

    (cheap_tokens, cheap), (slow_tokens, slow) = drafted(0.05), drafted(3.0)
    assert cheap_tokens == slow_tokens
    assert cheap["drafted_tokens"] > 24  # every draft accepted: k grows
    assert slow["drafted_tokens"] <= 48 // 16  # probes only: each would cost 3 target passes


# ------------------------------------------------------- the draft's prompt, by cost

def test_a_draft_prompt_chunk_never_exceeds_the_time_budget_at_its_measured_cost(tiny):
    """The issue: one chunk of a slow draft's prefill held every other request for seconds.
    Its chunks now hold at most what its measured cost fits in the budget, and a short
    request beside it finishes first."""
    from lockstep.server.engine import Engine

    clock = FakeClock()
    slow = Charged(peaked_llama(quant="affine"), clock, per_token=0.04)  # 25 tokens a second
    costs = measure_draft_costs(tiny.model, slow, context=16, clock=clock)
    assert costs.prefill_tokens() == int(DRAFT_PREFILL_BUDGET_S / 0.04)
    draft = WidestCall(slow)
    deployment = Deployment(draft_model=draft, prefill_chunk=64, draft_prefill_tokens=costs.prefill_tokens())
    long_prompt = [(i * 7) % 200 + 1 for i in range(160)]
    engine = Engine(tiny, max_active=4, deployment=deployment).start()
    try:
        order, out = finish_order(engine, [
            ("long", GenerationRequest(long_prompt, 6, GREEDY), plain(deployment, speculative="draft", k=3)),
            ("short", GenerationRequest([5, 6, 7], 3, GREEDY), plain(deployment)),
        ])
    finally:
        engine.stop()
    assert 0 < draft.widest <= costs.prefill_tokens(), f"a draft prefill chunk of {draft.widest} tokens"
    assert order == ["short", "long"]
    assert out["long"][0] == _answer(tiny, deployment, plain(deployment), long_prompt, n=6)[0]
