"""The scheduler's fairness (server/engine/scheduling/scheduler.py): no single request's work holds the
engine or its slots, and requests are counted as requests, not choices.

Each test replays a finding of the third adversarial round (issue 25) on the tiny random
llama (tests/tiny_models.py: token ids read back from the text), driven through the real
engine: the scheduler, the model runner and the request states.
"""
import asyncio
import struct

import httpx2 as httpx
import pytest

import lockstep.server.engine.runner.model_runner as model_runner
from lockstep.server.engine.guarantee.decode_plan import plan_request
from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.server.engine.generate import generate
from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.decoding.sampling import SamplingParams
from tests.deterministic_fixtures import TinyLoaded
from tests.doubles.shape_variant import shape_variant_backend
from tests.http_server import running, wait_until
from tests.test_deterministic_double import peaked_llama



@pytest.fixture(scope="module")
def tiny():
    return TinyLoaded(peaked_llama())


def finish_order(engine, submissions) -> tuple[list[str], dict]:
    """Submit (name, request, plan) in order, then wait for all: (names in the order their
    last Delta arrived, {name: (token ids, logprob bits)})."""
    order, out = [], {}

    async def main():
        handles = {name: engine.submit(request, plan) for name, request, plan in submissions}

        async def consume(name, handle):
            text, bits = "", []
            async for delta in handle:
                text += delta.text
                bits += [struct.pack(">d", lp.logprob) for lp in delta.logprobs]
            order.append(name)
            out[name] = ([ord(ch) - 0x4E00 for ch in text], bits)

        await asyncio.gather(*(consume(n, h) for n, h in handles.items()))

    asyncio.run(main())
    return order, out


def plain(deployment, **kw):
    return plan_request(deployment, deterministic=False, speculative=kw.get("speculative"),
                        num_draft_tokens=kw.get("k"))


# ------------------------------------------- 2. a long prompt with a draft model stalls everyone

class WidestCall:
    """Wraps a model: records the most tokens any one call (whole model or its body) took."""

    def __init__(self, inner):
        self.inner, self.widest = inner, 0
        outer = self

        class Body:
            def __call__(self, inputs, cache=None, **kw):
                outer.widest = max(outer.widest, inputs.shape[1])
                return inner.model(inputs, cache=cache, **kw)

            def __getattr__(self, name):
                return getattr(inner.model, name)

        self.model = Body()

    def __call__(self, inputs, cache=None, **kw):
        self.widest = max(self.widest, inputs.shape[1])
        return self.inner(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_draft_models_prompt_is_prefilled_a_chunk_at_a_time(tiny):
    """Finding 2: the draft model prefilled a whole long prompt in one call on the engine
    thread. Now its prompt goes in chunks like the target's, between other requests' passes,
    and a short request beside it finishes first."""
    from lockstep.server.engine import Engine

    draft = WidestCall(peaked_llama(quant="affine"))
    deployment = Deployment(draft_model=draft, prefill_chunk=8)
    engine = Engine(tiny, max_active=4, deployment=deployment).start()
    long_prompt = [(i * 7) % 200 + 1 for i in range(160)]
    greedy = SamplingParams(temperature=0.0)
    try:
        order, out = finish_order(engine, [
            ("long", GenerationRequest(long_prompt, 8, greedy), plain(deployment, speculative="draft", k=3)),
            ("short", GenerationRequest([5, 6, 7], 4, greedy), plain(deployment)),
        ])
    finally:
        engine.stop()
    assert draft.widest <= 8, f"the draft model took {draft.widest} tokens in one call"
    assert order == ["short", "long"]
    # the draft only changes how many passes it takes: the answer is the plain one
    alone = [t for d in generate(tiny, GenerationRequest(long_prompt, 8, greedy), deployment=deployment) if d
             for t in [ord(c) - 0x4E00 for c in d.text]]
    assert out["long"][0] == alone


def test_no_engine_step_runs_more_than_a_chunk_of_prompt_tokens_through_a_model(tiny, monkeypatch):
    """The class behind finding 2: every prompt chunk the runner runs, target or draft, holds
    at most --prefill-chunk tokens."""
    from lockstep.server.engine import Engine

    widest = []
    original = model_runner.prompt_forward
    monkeypatch.setattr(model_runner, "prompt_forward",
                        lambda model, cache, tokens: widest.append(len(tokens)) or original(model, cache, tokens))
    deployment = Deployment(draft_model=peaked_llama(quant="affine"), prefill_chunk=8)
    engine = Engine(tiny, max_active=4, deployment=deployment).start()
    try:
        finish_order(engine, [(f"r{i}", GenerationRequest(list(range(1, 60 + i)), 2, SamplingParams(temperature=0.0)),
                               plain(deployment, speculative="draft", k=2)) for i in range(3)])
    finally:
        engine.stop()
    assert widest and max(widest) <= 8
    assert sum(widest) >= 2 * 3 * 58  # the target's and the draft's prompts both went through


def test_a_plain_long_prompt_goes_in_plain_chunks_a_deterministic_one_in_canonical_chunks(tiny, monkeypatch):
    """Issue 54: a short request beside a long prompt waited for the long one's whole chunks.
    A plain prompt's chunks now hold at most `plain_prefill_chunk` tokens (shared or alone),
    so a short request beside it waits that long per step; a deterministic prompt keeps
    --prefill-chunk, whose shape its bits depend on."""
    from lockstep.server.engine import Engine

    widths = {"target": []}
    original = model_runner.prompt_forward
    original_ragged = model_runner.ragged_prompt_forward

    def alone(model, cache, tokens):
        widths["target"].append(len(tokens))
        return original(model, cache, tokens)

    def shared(model, members):
        widths["target"].extend(len(tokens) for _, tokens in members)
        return original_ragged(model, members)

    monkeypatch.setattr(model_runner, "prompt_forward", alone)
    monkeypatch.setattr(model_runner, "ragged_prompt_forward", shared)
    deployment = Deployment(prefill_chunk=32, plain_prefill_chunk=8)
    det = plan_request(deployment, deterministic=True, speculative=None, num_draft_tokens=None)
    long_prompt = [(i * 7) % 200 + 1 for i in range(100)]
    greedy = SamplingParams(temperature=0.0)
    engine = Engine(tiny, max_active=4, deployment=deployment).start()
    try:
        order, _ = finish_order(engine, [("long", GenerationRequest(long_prompt, 2, greedy), plain(deployment)),
                                         ("short", GenerationRequest([5, 6, 7], 2, greedy), plain(deployment))])
        plain_widths, widths["target"] = widths["target"], []
        finish_order(engine, [("deterministic", GenerationRequest(long_prompt, 2, greedy), det)])
    finally:
        engine.stop()
    assert order == ["short", "long"]
    assert max(plain_widths) == 8 and sum(plain_widths) == 99 + 2
    assert widths["target"] == [16, 16, 32, 32, 3]  # canonical chunks on the grid (16, 32, 64, ...)


def test_a_long_plain_prompt_leaves_every_other_step_to_decoding_requests(tiny, monkeypatch):
    """Issue 54: beside a long plain prompt a short request waited one of its chunks per
    token. While a request decodes, the long prompt's chunks now run every other step: the
    short request's tokens come at least two per long chunk run meanwhile."""
    from lockstep.server.engine import Engine

    events = []
    original = model_runner.prompt_forward
    original_ragged = model_runner.ragged_prompt_forward
    original_decode = ModelRunner.decode
    monkeypatch.setattr(model_runner, "prompt_forward",
                        lambda model, cache, tokens: events.append(len(tokens)) or original(model, cache, tokens))
    monkeypatch.setattr(model_runner, "ragged_prompt_forward", lambda model, members: events.extend(
        len(tokens) for _, tokens in members) or original_ragged(model, members))

    def decode(self, decode_pass, **kwargs):
        events.append("decode")
        return original_decode(self, decode_pass, **kwargs)

    monkeypatch.setattr(ModelRunner, "decode", decode)
    deployment = Deployment(prefill_chunk=32, plain_prefill_chunk=8)
    greedy = SamplingParams(temperature=0.0)
    long_prompt = [(i * 7) % 200 + 1 for i in range(200)]
    engine = Engine(tiny, max_active=4, deployment=deployment).start()
    try:
        order, _ = finish_order(engine, [("short", GenerationRequest([5, 6, 7], 12, greedy), plain(deployment)),
                                         ("long", GenerationRequest(long_prompt, 2, greedy), plain(deployment))])
    finally:
        engine.stop()
    assert order == ["short", "long"]
    # from the short request's first decode pass to its last one (the long prompt was still
    # prefilling all along: 199 tokens in chunks of 8)
    decodes = [i for i, event in enumerate(events) if event == "decode"]
    window = events[decodes[0]:decodes[11] + 1]
    assert set(window) == {"decode", 8} and sum(events[decodes[11]:].count(n) for n in (7, 8)) > 0
    assert 4 <= window.count(8) <= 6


def test_a_long_deterministic_prompt_yields_steps_to_decoding_requests_in_canonical_chunks(tiny, monkeypatch):
    """Issue 54: beside a long deterministic prompt a short request got one token per
    canonical chunk. The chunks keep --prefill-chunk's shape (the bits depend on it), but
    while a request decodes each waits as many steps as the plain chunks it spans: the short
    request's decode passes run between two of the long prompt's chunks, and the long
    answer's tokens and logprob bits are those it gets alone."""
    from lockstep.server.engine import Engine

    events = []
    original = model_runner.prompt_forward
    original_decode = ModelRunner.decode
    monkeypatch.setattr(model_runner, "prompt_forward",
                        lambda model, cache, tokens: events.append(len(tokens)) or original(model, cache, tokens))

    def decode(self, decode_pass, **kwargs):
        events.append("decode")
        return original_decode(self, decode_pass, **kwargs)

    monkeypatch.setattr(ModelRunner, "decode", decode)
    deployment = Deployment(prefill_chunk=32, plain_prefill_chunk=8)
    det = plan_request(deployment, deterministic=True, speculative=None, num_draft_tokens=None)
    greedy = SamplingParams(temperature=0.0, top_logprobs=0)
    long_prompt = [(i * 7) % 200 + 1 for i in range(200)]
    engine = Engine(tiny, max_active=4, deployment=deployment).start()
    try:
        _, alone = finish_order(engine, [("long", GenerationRequest(long_prompt, 6, greedy), det)])
        events.clear()
        order, beside = finish_order(engine, [("short", GenerationRequest([5, 6, 7], 12, greedy), plain(deployment)),
                                              ("long", GenerationRequest(long_prompt, 6, greedy), det)])
    finally:
        engine.stop()
    assert order == ["short", "long"]
    assert beside["long"] == alone["long"] and alone["long"][1]  # the same tokens and logprob bits
    chunks = [i for i, event in enumerate(events) if event in (16, 32)]
    # 199 prompt tokens: canonical chunks on the grid (16, 16, 5 x 32, then 7)
    assert [events[i] for i in chunks] == [16, 16] + [32] * 5
    # the short request's 12 decode passes come first (the long one decodes after its prompt)
    last_short = [i for i, event in enumerate(events) if event == "decode"][11]
    between = [(events[b], events[a:b].count("decode")) for a, b in zip(chunks, chunks[1:]) if b < last_short]
    # the short request's decode steps before each chunk: as many as the plain chunks it spans
    assert between and all(decodes >= width // 8 for width, decodes in between)


def test_the_cpu_deployment_chunks_deterministic_prompts_narrower_unless_told(monkeypatch):
    """Issue 54: a 512-token deterministic chunk held a short request beside it for 3-5 s on
    the CPU. Without --prefill-chunk the CPU deployment (serve's own flags, the embedded
    model) chunks deterministic prompts at CPU_PREFILL_CHUNK, and says so in its fingerprint;
    a given --prefill-chunk is kept."""
    import argparse

    import mlx.core as mx

    from lockstep.server.commands.runtime_args import add_determinism_arguments, add_model_arguments, options_from_args
    from lockstep.server.engine.guarantee.deployment import CPU_PLAIN_PREFILL_CHUNK, CPU_PREFILL_CHUNK, PREFILL_CHUNK
    from lockstep.server.runtime import build_runtime

    assert mx.default_device().type == mx.DeviceType.cpu
    monkeypatch.delenv("LOCKSTEP_BATCH_INVARIANT_LIMIT", raising=False)
    monkeypatch.delenv("MLX_METAL_BATCH_INVARIANT_LIMIT", raising=False)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_determinism_arguments(parser)
    default = build_runtime(options_from_args(parser.parse_args([]))).deployment
    told = build_runtime(options_from_args(parser.parse_args(["--prefill-chunk", str(PREFILL_CHUNK)]))).deployment
    assert CPU_PLAIN_PREFILL_CHUNK < CPU_PREFILL_CHUNK < PREFILL_CHUNK
    assert (default.prefill_chunk, default.plain_prefill_chunk) == (CPU_PREFILL_CHUNK, CPU_PLAIN_PREFILL_CHUNK)
    assert (told.prefill_chunk, told.plain_prefill_chunk) == (PREFILL_CHUNK, CPU_PLAIN_PREFILL_CHUNK)
    assert default.fingerprint != told.fingerprint  # the chunk width changes prompt KV bits


# ------------------------------------------------------ 3. n fills every slot

def test_one_request_with_a_large_n_leaves_a_slot_for_others(tiny):
    """Finding 3: n = max_active choices took every slot, and another client's 4-token
    request waited for one of them to finish. A request now holds at most
    `max_active_per_request` slots (default three quarters): the short request finishes
    first, and the big one's last choice starts as the others finish."""
    from lockstep.server.engine import Engine

    deployment = Deployment(prefill_chunk=8)
    engine = Engine(tiny, max_active=4, deployment=deployment)
    assert engine.describe()["max_active_per_request"] == 3
    seen_active = []
    observer = type("O", (), {"on_pass": lambda s, rows, n: seen_active.append(len(engine.scheduler.active))})()
    engine.observers.append(observer)
    engine.start()
    sampled = SamplingParams(temperature=0.9, seed=1)
    try:
        async def main():
            big = engine.submit_group([GenerationRequest([9, 8, 7], 40, sampled) for _ in range(4)], plain(deployment))
            await asyncio.sleep(0)
            short = engine.submit(GenerationRequest([1, 2, 3], 4, sampled), plain(deployment))
            order = []

            async def consume(name, handle):
                async for _ in handle:
                    pass
                order.append(name)

            await asyncio.gather(consume("short", short), *(consume(f"big{i}", h) for i, h in enumerate(big)))
            return order

        order = asyncio.run(main())
    finally:
        engine.stop()
    assert order[0] == "short"
    assert sorted(order[1:]) == ["big0", "big1", "big2", "big3"]  # every choice was answered
    assert max(seen_active) <= 4


def _held(engine, named) -> dict[str, int]:
    """Slots held per request, by the name of its first choice's handle."""
    names = {id(handles[0]): name for name, handles in named.items()}
    held = {}
    for slot in engine.scheduler.active:
        name = names[id(slot.handle.leader or slot.handle)]
        held[name] = held.get(name, 0) + 1
    return held


async def _submit(engine, groups: dict[str, list[GenerationRequest]], plan) -> dict[str, list]:
    return {name: engine.submit_group(requests, plan) for name, requests in groups.items()}


@pytest.mark.parametrize("max_active, held", [(16, {"a": 12, "b": 3}), (4, {"a": 3})])
def test_two_requests_with_a_large_n_leave_a_slot_for_a_plain_one(tiny, max_active, held):
    """Issue 49, finding 9: two n = 16 requests took 12 + 4 = every slot of 16 (each within
    its own share), and a plain request waited for one of their choices to finish. No choice
    of an n > 1 request takes the last free slot now (on 4 slots not even the second request's
    first), so the plain request is admitted in the same admission round, and again after it
    leaves."""
    from lockstep.server.engine import Engine

    deployment = Deployment(prefill_chunk=8)
    engine = Engine(tiny, max_active=max_active, deployment=deployment)  # not started: admission by hand
    sampled = SamplingParams(temperature=0.9, seed=1)
    big = [GenerationRequest([9, 8, 7], 40, sampled) for _ in range(max_active)]
    named = asyncio.run(_submit(engine, {"a": big, "b": big, "plain": [GenerationRequest([1, 2, 3], 4, sampled)]},
                                plain(deployment)))
    scheduler = engine.scheduler
    try:
        scheduler.admit()
        assert _held(engine, named) == {**held, "plain": 1}
        done = named.pop("plain")[0]
        scheduler.remove(next(s for s in scheduler.active if s.handle is done))
        scheduler.admit()  # the n > 1 choices still waiting do not take the slot it left
        assert len(scheduler.active) == max_active - 1
        named.update(asyncio.run(_submit(engine, {"plain2": [GenerationRequest([4, 5], 4, sampled)]},
                                         plain(deployment))))
        scheduler.admit()
        assert _held(engine, named) == {**held, "plain2": 1}
    finally:
        for slot in list(scheduler.active):
            scheduler.remove(slot)


def test_on_one_slot_the_choices_of_a_request_run_in_turn(tiny):
    """A server of one slot keeps none back: n = 3 is answered, one choice after another."""
    from lockstep.server.engine import Engine

    deployment = Deployment(prefill_chunk=8)
    engine = Engine(tiny, max_active=1, deployment=deployment).start()
    try:
        async def main():
            handles = engine.submit_group([GenerationRequest([9, 8, 7], 3, SamplingParams(temperature=0.0))] * 3,
                                          plain(deployment))
            return [[d async for d in handle] for handle in handles]

        answers = asyncio.run(main())
    finally:
        engine.stop()
    assert len(answers) == 3 and all(answers)


def test_the_per_request_share_is_a_serve_flag_checked_at_startup():
    from lockstep.server.commands.serve import add_arguments
    from lockstep.server.engine import Engine

    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--max-active-per-request", "2"]).max_active_per_request == 2
    with pytest.raises(ValueError, match="max_active_per_request"):
        Engine(TinyLoaded(peaked_llama()), max_active=4, max_active_per_request=5)


# ------------------------------------------------ 8. n above max_active + max_queue, 10. cancelled

@pytest.fixture(scope="module")
def small_server(tiny):
    """(url, engine): the tiny model behind the API, 2 slots and a queue of 1."""
    from lockstep.server.api.app import create_app
    from lockstep.server.api.limits import Limits
    from lockstep.server.engine import Engine

    engine = Engine(tiny, max_active=2, deployment=Deployment(prefill_chunk=8)).start()
    try:
        with running(create_app(engine, limits=Limits(max_queue=1))) as url:
            yield url, engine
    finally:
        engine.stop()


def test_n_above_the_slots_and_the_queue_is_served_on_an_idle_server(small_server):
    """Finding 8: n = 5 on a server of 2 slots and a queue of 1 got 429 "retry shortly" while
    idle, which no retry could change. A request's choices count as one waiting request."""
    url, _ = small_server
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "default", "prompt": [4, 5, 6], "max_tokens": 3, "n": 5, "temperature": 0.8,
                         "seed": 2})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3, 4]


def test_over_http_a_plain_request_is_answered_beside_a_running_n2_request(small_server):
    """Finding 9 of issue 49 through the official client, on 2 slots: a streamed n = 2 request
    of 2000 tokens a choice used to take both (its own share is 2), so a 2-token request waited
    for one of its choices to finish. Now the plain request is answered while both choices
    are still with the engine (the first running, the second kept out of the last slot)."""
    from openai import OpenAI

    url, engine = small_server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="default", prompt=[7, 8, 9], max_tokens=2000, n=2, stream=True)
    try:
        next(iter(stream))  # the big request has started
        answer = client.completions.create(model="default", prompt=[1, 2, 3], max_tokens=2)
        assert answer.usage.completion_tokens == 2
        counts = engine.counts()
        assert counts["active"] + counts["waiting"] == 2, counts  # neither of its choices has finished
    finally:
        stream.close()
    wait_until(lambda: engine.counts()["active"] == 0 and engine.counts()["waiting"] == 0,
               what="the cancelled choices to leave")


def test_cancelled_counts_requests_not_choices(small_server):
    """Finding 10: five cancelled n = 3 streams counted 15. Each cancelled request counts once,
    in /health and in the metric alike."""
    url, engine = small_server
    before = httpx.get(url + "/health").json()["cancelled"]
    for _ in range(2):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": "default", "prompt": [7, 8, 9], "max_tokens": 2000, "n": 3,
                                "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break  # the client goes away with every choice still running
        wait_until(lambda: engine.counts()["active"] == 0 and engine.counts()["waiting"] == 0,
                   what="the cancelled choices to leave")
    health = httpx.get(url + "/health").json()
    assert health["cancelled"] - before == 2
    metrics = httpx.get(url + "/metrics").text
    line = next(l for l in metrics.splitlines() if l.startswith("lockstep_cancelled_requests"))
    assert float(line.split()[-1]) == health["cancelled"]


# ------------------------------------------- 11. a deterministic request on an L = 0 deployment

def test_on_l0_a_deterministic_request_runs_in_passes_of_its_own_beside_others(tiny, monkeypatch):
    """Finding 11: it ran alone on the engine and every other request queued behind it. Now
    it runs in passes of its own while the others go on: a short plain request submitted
    after it finishes first, no pass mixes it with another request, and under the
    shape-variant double (where sharing a pass changes bits) its answer is its solo answer."""
    from lockstep.server.engine import Engine

    deployment = Deployment(prefill_chunk=8)
    det = plan_request(deployment, deterministic=True, speculative=None, num_draft_tokens=None)
    assert det.determinism == "alone"
    mixed = []
    original = ModelRunner.decode

    def recording(self, decode_pass, **kwargs):
        kinds = [slot.state.determinism for slot, _ in decode_pass.members]
        mixed.append("alone" in kinds and len(kinds) > 1)
        return original(self, decode_pass, **kwargs)

    monkeypatch.setattr(ModelRunner, "decode", recording)
    seeded = SamplingParams(temperature=0.8, seed=5, top_logprobs=2)
    long_request = GenerationRequest([3, 4, 5, 6], 40, seeded)
    with shape_variant_backend():
        solo = [(lp.token, struct.pack(">d", lp.logprob)) for d in
                generate(tiny, long_request, plan=det, deployment=deployment) if d for lp in d.logprobs]
        engine = Engine(tiny, max_active=8, deployment=deployment).start()
        try:
            order, out = finish_order(engine, [("deterministic", long_request, det)] + [
                (f"plain{i}", GenerationRequest([i + 1, 9, 9], 4 + 8 * i, seeded), plain(deployment))
                for i in range(4)])
        finally:
            engine.stop()
    assert order[0] == "plain0"
    assert not any(mixed)
    assert len([m for m in mixed if m is False]) > 40  # it did run, and others ran beside it
    tokens, bits = out["deterministic"]
    assert bits == [b for _, b in solo]
    assert "".join(chr(0x4E00 + t) for t in tokens) == "".join(t for t, _ in solo)


def test_negative_control_the_same_request_sharing_passes_changes_its_answer(tiny):
    """Without passes of its own (planned as a plain request), the double's batched
    reductions change the request's logprobs: the rule above is what keeps them."""
    from lockstep.server.engine import Engine

    deployment = Deployment(prefill_chunk=8)
    seeded = SamplingParams(temperature=0.8, seed=5, top_logprobs=2)
    long_request = GenerationRequest([3, 4, 5, 6], 40, seeded)
    with shape_variant_backend():
        solo = [struct.pack(">d", lp.logprob) for d in generate(tiny, long_request, deployment=deployment) if d
                for lp in d.logprobs]
        engine = Engine(tiny, max_active=8, deployment=deployment).start()
        try:
            _, out = finish_order(engine, [("shared", long_request, plain(deployment))] + [
                (f"plain{i}", GenerationRequest([i + 1, 9, 9], 4 + 8 * i, seeded), plain(deployment))
                for i in range(4)])
        finally:
            engine.stop()
    assert out["shared"][1] != solo


# ------------------------------------------- admission under the KV budget is first come, first served

def test_a_request_the_kv_budget_cannot_hold_yet_keeps_its_place_in_the_queue(tiny):
    """A request waiting for KV to be released is not overtaken by a later one that fits now:
    a stream of small requests would otherwise keep a large one waiting for ever."""
    import time
    from types import SimpleNamespace

    from lockstep.server.engine.scheduling.kv_budget import KVBudget, reservation
    from lockstep.server.engine.scheduling.scheduler import Scheduler

    deployment = Deployment()
    runner = SimpleNamespace(kv_pool=None, batched=True, release=lambda cache: None)

    def handle(max_tokens):
        return SimpleNamespace(request=GenerationRequest([1, 2, 3], max_tokens, SamplingParams(temperature=0)),
                               plan=plain(deployment), leader=None, cancelled=False, client_cancelled=False,
                               submitted_at=time.monotonic(), state=None)

    def admitted(*queue):
        # room for the large request alone, or for two small ones, never for a large and a small
        budget = KVBudget(reservation(3, 300, 0) + reservation(3, 4, 0) - 1)
        scheduler = Scheduler(tiny, runner, deployment=deployment, max_active=4, active_per_request=4,
                              max_batch_rows=16, kv_budget=budget)
        scheduler.waiting = list(queue)
        scheduler.admit()
        return [queue.index(slot.handle) for slot in scheduler.active]

    small, large, later = handle(4), handle(300), handle(4)
    assert admitted(small, later) == [0, 1]  # control: two small ones fit together
    assert admitted(small, large, later) == [0]  # the large one waits first in line, the later one behind it


def test_a_request_the_pools_split_free_slots_cannot_hold_waits_without_holding_budget(tiny):
    """The KV pool grows no further than the KV budget: where the budget has room for a
    request but the pool's free slots are split into shorter ranges, the request waits (its
    reservation given back) until a release joins them, and is admitted then."""
    import time
    from types import SimpleNamespace

    from lockstep.kernels.batching.kv_pool import KVPool
    from lockstep.server.engine.scheduling.kv_budget import KVBudget, reservation
    from lockstep.server.engine.scheduling.scheduler import Scheduler

    deployment = Deployment()
    span = 400
    pool = KVPool(tiny.model, 3 * span, use_kernel=False, max_capacity=3 * span)
    first, middle, last = (pool.allocate(span) for _ in range(3))
    pool.release(first)
    pool.release(last)  # 800 free slots, in two ranges of 400
    runner = SimpleNamespace(kv_pool=pool, batched=True, release=pool.release, new_cache=pool.allocate)
    budget = KVBudget(3 * span)
    assert budget.try_reserve(span)  # the middle range's request
    request = SimpleNamespace(request=GenerationRequest([1, 2, 3], 300, SamplingParams(temperature=0)),
                              plan=plain(deployment), leader=None, cancelled=False, client_cancelled=False,
                              submitted_at=time.monotonic(), state=None)
    assert span < reservation(3, 300, 0) <= 2 * span
    scheduler = Scheduler(tiny, runner, deployment=deployment, max_active=4, active_per_request=4,
                          max_batch_rows=16, kv_budget=budget)
    scheduler.waiting = [request]
    scheduler.admit()
    assert scheduler.active == [] and scheduler.waiting == [request] and budget.reserved == span
    assert pool.capacity == 3 * span  # not grown past the budget
    pool.release(middle)
    budget.release(span)
    scheduler.admit()
    assert [slot.handle for slot in scheduler.active] == [request]
    assert budget.reserved == reservation(3, 300, 0) and pool.capacity == 3 * span
