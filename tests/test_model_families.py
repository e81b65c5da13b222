"""Every mlx-lm family people serve is served, batched: dense, MoE, sliding-window and hybrid
(recurrent or conv state) models, from tiny random-weight models of mlx-lm's own classes
(tests/model_families.py).

Layers with per-request state (ArraysCache, RotatingKVCache) run once per request inside a
ragged pass (kernels/batching/ragged.py); the attention layers with plain KV caches run once
for the whole pass. Each request's batched answer is its solo answer, token for token
(greedy, with a peaked output head so no near-tie decides a token).

Below, every family is also deterministic (docs/MODELS.md): bitwise answers alone, batched,
after a prefix-cache hit and with prompt lookup, and a negative control per family.
"""
import asyncio
import struct

import mlx.core as mx
import pytest

from lockstep.kernels.batching.ragged import ragged_problem
from lockstep.kernels.batching.ragged_selftest import per_request_self_test
from lockstep.kernels.invariance import set_batch_invariant_limit
from lockstep.server.engine import Engine
from lockstep.server.engine.guarantee.decode_plan import RequestRejected, plan_request
from lockstep.server.engine.guarantee.deployment import Deployment, rewind_refusal
from lockstep.server.engine.generate import generate
from lockstep.server.engine.guarantee.deployment import proven_deployment
from lockstep.server.engine.guarantee.guarantee import Guarantee
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from lockstep.server.model_loading import rewindable
from tests.deterministic_fixtures import TinyLoaded
from tests.doubles.shape_variant import shape_variant_backend
from tests.model_families import FAMILIES, tiny_family

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [list(range(1, 12)), [40, 41, 42, 40, 41, 42, 40], list(range(100, 131))]
TOKENS = 8


def peaked(model):
    """The family's model with its output head scaled up: greedy answers far from ties."""
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "weight"):
        head.weight = head.weight * 8
    mx.eval(model.parameters())
    return model


def ids(text: str) -> list[int]:
    return [ord(c) - 0x4E00 for c in text]


def solo(loaded, deployment, prompt) -> list[int]:
    request = GenerationRequest(prompt, TOKENS, GREEDY)
    return ids("".join(d.text for d in generate(loaded, request, deployment=deployment) if d))


def batched(loaded, deployment, prompts) -> tuple[list[list[int]], dict, int]:
    """All prompts at once through the engine: (answers, engine description, widest pass)."""
    widest = []
    observer = type("O", (), {"on_pass": lambda s, rows, n: widest.append(n)})()

    async def main():
        engine = Engine(loaded, max_active=4, deployment=deployment)
        engine.observers.append(observer)
        engine.start()
        try:
            plan = plan_request(deployment, deterministic=False, speculative=None, num_draft_tokens=None)
            handles = [engine.submit(GenerationRequest(p, TOKENS, GREEDY), plan) for p in prompts]
            out = []
            for handle in handles:
                text = ""
                async for delta in handle:
                    text += delta.text
                out.append(ids(text))
            return out, engine.describe()
        finally:
            engine.stop()

    answers, described = asyncio.run(main())
    return answers, described, max(widest)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_served_batched_with_its_solo_answers(family):
    model = peaked(tiny_family(family))
    loaded = TinyLoaded(model)
    deployment = Deployment(prefill_chunk=8, speculation=rewindable(model))
    alone = [solo(loaded, deployment, p) for p in PROMPTS]
    together, described, widest = batched(loaded, deployment, PROMPTS)
    assert described["batched"] is True and ragged_problem(model) is None
    assert widest >= 2  # requests really shared passes
    assert all(len(a) == TOKENS for a in alone)
    assert together == alone


# Each family whose state cannot be rewound, and the words its refusal of speculation uses.
UNREWINDABLE = {"gemma3_text": "sliding-window attention", "gpt_oss": "sliding-window attention",
                "qwen3_next": "hybrid model's recurrent or conv layers",
                "granitemoehybrid": "hybrid model's recurrent or conv layers",
                "lfm2": "hybrid model's recurrent or conv layers"}


@pytest.mark.parametrize("family", sorted(UNREWINDABLE))
def test_state_that_cannot_be_rewound_turns_speculation_off_by_name(family):
    """Issue 49, finding 14c: the reason is worded for the family's kind of state (a sliding
    window was blamed on "recurrent state"); a deterministic request that asks for drafts is
    decoded without them (its answer is the same by contract) and its note says why."""
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_family(family)
    assert not rewindable(model)
    why = rewind_refusal(make_prompt_cache(model))
    assert UNREWINDABLE[family] in why and ("recurrent" in why) is (family not in ("gemma3_text", "gpt_oss"))
    deployment = Deployment(speculation=False, speculation_refusal=why, speculative="prompt_lookup",
                            guarantee=Guarantee(4, proven=True))
    assert plan_request(deployment, deterministic=False, speculative=None, num_draft_tokens=None).method == "none"
    with pytest.raises(RequestRejected) as info:
        plan_request(deployment, deterministic=False, speculative="prompt_lookup", num_draft_tokens=3)
    assert info.value.param == "speculative" and why in str(info.value)
    for method in ("prompt_lookup", "draft"):
        plan = plan_request(deployment, deterministic=True, speculative=method, num_draft_tokens=3)
        assert (plan.method, plan.num_draft_tokens, plan.guaranteed) == ("none", 0, True)
        assert plan.note == f"decoded without drafts ({method} asked for): {why}"


def test_a_recurrent_model_is_named_as_one():
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    assert "this recurrent model's state (ArraysCache)" in rewind_refusal([ArraysCache(2), ArraysCache(2)])
    assert rewind_refusal([KVCache(), KVCache()]) is None
    assert "sliding-window" in rewind_refusal([RotatingKVCache(max_size=8), KVCache()])


def test_plain_kv_families_keep_speculation():
    assert rewindable(tiny_family("llama")) and rewindable(tiny_family("qwen3_moe"))


# ------------------------------------------------------------------ deterministic, every family
#
# Each family with L installed and proven under the shape-variant double (tests/doubles/
# shape_variant.py: calls of several rows reduce in another order, as on a GPU), its guarantee
# decided as at startup (guarantee.py: the ragged proof). Deterministic answers are compared
# as token ids and logprob bits: alone (cold), alone after a prefix-cache hit, batched beside
# plain requests, and with prompt lookup. Families with per-request state (sliding window,
# recurrent or conv state) are proven for one row per request: no speculation (prompt lookup,
# asked for, is left out and the plan's note says so) and no prefix-cache hits (their state
# is never stored).

LIMIT = 4
DET_TOKENS = 6
# prompts that repeat, so prompt lookup drafts; none is a prefix of another
DET_PROMPTS = [[11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11], [30, 31, 32, 33, 30, 31, 32, 33, 30],
               [70, 71, 70, 71, 70, 71, 72, 73, 70, 71]]
DET_SAMPLING = [SamplingParams(temperature=0.0, top_logprobs=2),
                SamplingParams(temperature=0.8, seed=7, top_logprobs=2),
                SamplingParams(temperature=0.7, top_p=0.9, seed=3, top_logprobs=2)]
OTHER_PROMPTS = [[5, 6, 7, 8, 9], [90, 91, 92, 93, 94, 95, 96], [120, 121, 120, 121, 120]]


class PassWidths:
    def __init__(self):
        self.requests = []

    def on_pass(self, rows, requests):
        self.requests.append(requests)


def serve_family(family: str, *, proven: bool = True):
    """(engine, pass log) for the family's tiny model under the double: L installed and its
    guarantee decided as at startup, or (proven=False) nothing installed and a deployment
    that claims shared deterministic passes anyway (the negative control)."""
    model = tiny_family(family)
    with shape_variant_backend():
        if proven:
            invariance = set_batch_invariant_limit(model, LIMIT, per_request_proof=per_request_self_test)
            assert invariance.guaranteed, invariance.reason
            deployment = proven_deployment(model, invariance, prefill_chunk=8)
        else:
            deployment = Deployment(guarantee=Guarantee(LIMIT, proven=True, shared_passes=True), prefill_chunk=8,
                                    speculation=rewindable(model))
        engine = Engine(TinyLoaded(model), max_active=8, deployment=deployment, prefix_cache=PrefixCache(8))
    log = PassWidths()
    engine.observers.append(log)
    return engine, log


def det_job(engine, i: int, speculative: str = "none"):
    plan = plan_request(engine.deployment, deterministic=True, speculative=speculative,
                        num_draft_tokens=3 if speculative != "none" else None)
    return GenerationRequest(DET_PROMPTS[i], DET_TOKENS, DET_SAMPLING[i]), plan


def other_jobs(engine):
    plan = plan_request(engine.deployment, deterministic=False, speculative=None, num_draft_tokens=None)
    return [(GenerationRequest(p, DET_TOKENS + 4, SamplingParams(temperature=0.9, seed=i)), plan)
            for i, p in enumerate(OTHER_PROMPTS)]


def run_jobs(engine, jobs) -> list:
    """All jobs submitted at once; each answer as (token ids, logprob bits, top-logprob bits)."""

    async def main():
        handles = [engine.submit(request, plan) for request, plan in jobs]
        out = []
        for handle in handles:
            ids_, bits, tops = [], [], []
            async for delta in handle:
                for lp in delta.logprobs:
                    ids_ += ids(lp.token)
                    bits.append(struct.pack(">d", lp.logprob))
                    tops.append([(t, struct.pack(">d", v)) for t, v in lp.top])
            out.append((ids_, bits, tops))
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_deterministic_alone_batched_after_a_prefix_hit_and_with_prompt_lookup(family):
    engine, log = serve_family(family)
    kv_only = rewindable(engine.loaded.model)
    deployment = engine.deployment
    assert deployment.guarantee.shared_passes and deployment.guarantee.call_rows == LIMIT  # the ragged proof passed
    assert deployment.speculation is kv_only
    engine.start()
    try:
        with shape_variant_backend():
            jobs = [det_job(engine, i) for i in range(len(DET_PROMPTS))]
            assert all(plan.determinism == "shared" and plan.guaranteed for _, plan in jobs)
            cold = [run_jobs(engine, [job])[0] for job in jobs]
            hit = [run_jobs(engine, [job])[0] for job in jobs]
            hits_alone = engine.prefix_cache.hits
            log.requests.clear()
            together = run_jobs(engine, jobs + other_jobs(engine))[:len(jobs)]
            batched_widest = max(log.requests)
            if kv_only:
                lookup = [det_job(engine, i, "prompt_lookup") for i in range(len(jobs))]
                assert all(plan.method == "prompt_lookup" and plan.num_draft_tokens == 3 for _, plan in lookup)
                looked_up_alone = [run_jobs(engine, [job])[0] for job in lookup]
                looked_up_together = run_jobs(engine, lookup + other_jobs(engine))[:len(jobs)]
            else:  # asked for, prompt lookup is left out: the same answers, said in the note
                lookup = [det_job(engine, i, "prompt_lookup") for i in range(len(jobs))]
                assert all(plan.method == "none" and "decoded without drafts" in plan.note for _, plan in lookup)
                looked_up_alone = [run_jobs(engine, [job])[0] for job in lookup]
                looked_up_together = run_jobs(engine, lookup + other_jobs(engine))[:len(jobs)]
    finally:
        engine.stop()
    assert all(len(answer[0]) == DET_TOKENS for answer in cold)
    assert hit == cold
    assert together == cold
    assert batched_widest >= 3  # deterministic and plain requests really shared passes
    assert looked_up_alone == cold and looked_up_together == cold
    if kv_only:
        assert hits_alone >= len(jobs)  # the second runs started from cached prompt KV
    else:
        assert engine.prefix_cache.hits == 0  # per-request state is never stored: no hit, said at startup


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_every_family_diverges_batched_without_invariant_forms(family):
    """The same sharing with nothing installed: deterministic rows beside others reduce in
    another order under the double, so some deterministic answer changes."""
    engine, log = serve_family(family, proven=False)
    engine.start()
    try:
        with shape_variant_backend():
            jobs = [det_job(engine, i) for i in range(len(DET_PROMPTS))]
            alone = [run_jobs(engine, [job])[0] for job in jobs]
            log.requests.clear()
            together = run_jobs(engine, jobs + other_jobs(engine))[:len(jobs)]
    finally:
        engine.stop()
    assert max(log.requests) >= 3
    assert any(a != b for a, b in zip(alone, together))


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "lfm2"])
def test_the_ragged_proof_covers_per_request_state_and_fails_natively(family):
    from lockstep.kernels.batching.ragged import enable_ragged
    from lockstep.kernels.batching.ragged_selftest import prove_ragged

    model = tiny_family(family)
    enable_ragged(model)
    with shape_variant_backend():
        native = prove_ragged(model, LIMIT)
        assert not native and "differ" in native.reason  # negative control
        invariance = set_batch_invariant_limit(model, LIMIT, per_request_proof=per_request_self_test)
        assert invariance.guaranteed and invariance.request_rows == 1
        assert prove_ragged(model, LIMIT)  # one-row and multi-row members, each its own state
    set_batch_invariant_limit(model, 0)


def test_models_that_keep_no_plain_kv_say_why_they_neither_speculate_nor_hit_the_prefix_cache():
    from lockstep.server.runtime import Runtime, state_refusal

    assert state_refusal(tiny_family("llama")) is None and state_refusal(tiny_family("mixtral")) is None
    why = state_refusal(tiny_family("granitemoehybrid"))
    assert why.startswith("layer 0: ArraysCache (recurrent or conv state)") and "prefix cache" in why
    assert "RotatingKVCache (a sliding window)" in state_refusal(tiny_family("gpt_oss"))
    guarantee = Guarantee(4, proven=True, strategy="rowwise", request_rows=1)
    info = Runtime(TinyLoaded(tiny_family("lfm2")), Deployment(guarantee=guarantee, speculation=False), None, None,
                   "weights=float32", state_refusal=state_refusal(tiny_family("lfm2"))).model_info()
    assert info["prefix_cache"] == {"stores_prompts": False, "reason": state_refusal(tiny_family("lfm2"))}
    assert info["speculation"]["available"] is False and info["batch_invariance"]["request_rows"] == 1


@pytest.mark.parametrize("family", sorted(UNREWINDABLE))
def test_a_deterministic_request_for_drafts_is_served_without_them_and_v1_models_says_so(family):
    """Issue 49, finding 14c, over HTTP with the official client: the deterministic request
    that asks for prompt lookup was a 400; it is served, with the answer it gets without
    asking, and `lockstep.note` says why. /v1/models says the same for every such family."""
    from mlx_lm.models.cache import make_prompt_cache
    from openai import OpenAI

    from lockstep.server.api.app import create_app
    from lockstep.server.runtime import Runtime, state_refusal
    from tests.http_server import running

    model = tiny_family(family)
    why = rewind_refusal(make_prompt_cache(model))
    invariance = set_batch_invariant_limit(model, LIMIT, per_request_proof=per_request_self_test)
    try:
        deployment = proven_deployment(model, invariance, prefill_chunk=8)
        loaded = TinyLoaded(model)
        runtime = Runtime(loaded, deployment, None, invariance, "weights=float32", state_refusal=state_refusal(model))
        engine = Engine(loaded, max_active=4, deployment=deployment).start()
        try:
            with running(create_app(engine, model_extras=runtime.model_info)) as url:
                client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

                def complete(**extra):
                    return client.completions.create(model="tiny", prompt=DET_PROMPTS[0], max_tokens=4,
                                                     temperature=0, extra_body={"deterministic": True, **extra})

                asked, plain = complete(speculative="prompt_lookup", num_draft_tokens=3), complete()
                card = client.models.retrieve("tiny").model_extra["lockstep"]
        finally:
            engine.stop()
    finally:
        set_batch_invariant_limit(model, 0)
    extension = asked.model_extra["lockstep"]
    assert extension["note"] == f"decoded without drafts (prompt_lookup asked for): {why}"
    assert (extension["speculative"], extension["guaranteed"]) == ("none", True)
    assert asked.choices[0].text == plain.choices[0].text and "note" not in plain.model_extra["lockstep"]
    assert card["speculation"]["available"] is False and card["speculation"]["reason"] == why
    assert "decoded without drafts" in card["speculation"]["requested"]
    assert card["batch_invariance"]["guaranteed"] is True and card["batch_invariance"]["request_rows"] == 1
