"""Deterministic mode end to end: the official `openai` client against live servers on loopback.

The in-process server is assembled like `lockstep serve --batch-invariant-limit 6` does it
(server/runtime.py): batch invariance installed and self-tested on the embedded model, a
Deployment with a draft model, an Engine with a prefix cache, the deployment's
system_fingerprint. Every answer is compared bitwise: token strings and bytes, logprobs
(IEEE-754 bits) and top alternatives, text.

Cost (2 CPU cores): every request is reused across assertions; the draft model (the target's
weights rounded through 4 bits, in float32) is as deep as the target, so a draft token costs
a plain one: draft requests run DRAFTED tokens, compared
with plain answers of the same length (each verifies drafts, accepts and rejects some). Prompts
were picked to run the full 64 tokens.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.deterministic_fixtures import float_bits
from tests.http_server import running, wait_for_health

L = 6
CHUNK = 4  # prefill chunk <= L: a prefix-cache hit resumes exactly where the cached prefix ends
TOKENS = 64
DRAFTED = 32  # a draft-model request's tokens: enough drafts verified, accepted and rejected
ROOT = Path(__file__).resolve().parent.parent

HELLO = [{"role": "user", "content": "Write the word 'hello' forty times, separated by spaces."}]
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
OTHER = [{"role": "user", "content": "Name three rivers in Europe and say where they flow."}]
GREEDY = dict(temperature=0, max_tokens=TOKENS, logprobs=True, top_logprobs=3)
SEEDED = dict(temperature=0.8, top_p=0.95, seed=1234, max_tokens=TOKENS, logprobs=True, top_logprobs=3)


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple  # (token text, its bytes) per generated token
    logprobs: tuple  # IEEE-754 bits of each token's logprob
    tops: tuple  # ((token, bytes, logprob bits), ...) per token
    finish_reason: str
    completion_tokens: int
    lockstep: dict  # the response's `lockstep` object, its receipt apart
    fingerprint: str
    receipt: dict

    def bits(self) -> tuple:
        """Everything that must be identical between two deterministic answers (the receipt's
        digests of the answer's tokens and logprob bits included)."""
        return (self.text, self.tokens, self.logprobs, self.tops, self.finish_reason,
                self.receipt["answer"], self.receipt["logprobs"])


def _answer(text, content, finish, usage, lockstep, fingerprint) -> Answer:
    return Answer(
        text=text,
        tokens=tuple((t.token, tuple(t.bytes)) for t in content),
        logprobs=tuple(float_bits(t.logprob) for t in content),
        tops=tuple(tuple((a.token, tuple(a.bytes), float_bits(a.logprob)) for a in t.top_logprobs)
                   for t in content),
        finish_reason=finish, completion_tokens=usage, fingerprint=fingerprint,
        lockstep={k: v for k, v in (lockstep or {}).items() if k != "receipt"}, receipt=(lockstep or {})["receipt"])


def chat(client, messages, sampling, *, method=None, k=None, deterministic=True, stream=False) -> Answer:
    extra = {"deterministic": deterministic}
    if method is not None:
        extra["speculative"] = method
    if k is not None:
        extra["num_draft_tokens"] = k
    args = dict(model="default", messages=messages, extra_body=extra, **sampling)
    if not stream:
        r = client.chat.completions.create(**args)
        c = r.choices[0]
        return _answer(c.message.content, c.logprobs.content, c.finish_reason, r.usage.completion_tokens,
                       (r.model_extra or {}).get("lockstep"), r.system_fingerprint)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    choices = [c.choices[0] for c in chunks if c.choices]
    content = [t for ch in choices if ch.logprobs and ch.logprobs.content for t in ch.logprobs.content]
    extensions = [(c.model_extra or {}).get("lockstep") for c in chunks]
    extensions = [e for e in extensions if e]
    assert len(extensions) == 1  # once, with the finish
    assert len({c.system_fingerprint for c in chunks}) == 1
    return _answer("".join(ch.delta.content or "" for ch in choices), content,
                   next(ch.finish_reason for ch in choices if ch.finish_reason),
                   chunks[-1].usage.completion_tokens, extensions[0], chunks[0].system_fingerprint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ servers

@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A real `lockstep serve` process, started now so it loads while the in-process tests
    run; the restart test (last in this module) waits for it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCKSTEP_BATCH_INVARIANT_LIMIT",
                                                            "MLX_METAL_BATCH_INVARIANT_LIMIT")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.server.cli", "--log-level", "WARNING", "serve", "--batch-invariant-limit", str(L),
         "--prefill-chunk", str(CHUNK), "--port", str(port),
         "--max-batch-rows", str(L),  # the restart is the point here, not wide passes: prove 1..L only
         "--cpu-blas", "reference"],  # as the in-process server it is compared with (auto = q4)
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield SimpleNamespace(proc=proc, url=f"http://127.0.0.1:{port}", log=log.name)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


@pytest.fixture(scope="module")
def draft_model():
    """The target's float32 weights rounded through affine 4-bit and back: it guesses as a 4-bit
    copy does (agreeing often, not always) at the cost of a float32 pass, where MLX's 4-bit
    CPU kernels would make each draft token cost several target passes."""
    import mlx.core as mx
    import mlx.nn as nn

    from lockstep.models.load import load_model

    draft = load_model("default", weights="float32")
    for _, module in draft.model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight = mx.dequantize(*mx.quantize(module.weight, group_size=64, bits=4), group_size=64, bits=4)
    mx.eval(draft.model.parameters())
    return draft.model


@pytest.fixture(scope="module")
def server(restarted, embedded_model, draft_model):
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels import cpu_blas
    from lockstep.kernels.invariance import cache_invariance_problem, set_batch_invariant_limit
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.deployment import proven_deployment
    from lockstep.server.fingerprint import system_fingerprint
    from lockstep.server.engine.cache.prefix_cache import PrefixCache

    invariance = set_batch_invariant_limit(embedded_model.model, L)
    try:
        assert invariance.guaranteed, invariance.reason
        assert cache_invariance_problem(make_prompt_cache(embedded_model.model)) is None
        transform = f"weights={embedded_model.weights}"
        fingerprint = system_fingerprint(embedded_model.path, transform=transform, strategy=invariance.strategy,
                                         limit=invariance.call_rows, blas=cpu_blas.describe(), prefill_chunk=CHUNK)
        deployment = proven_deployment(embedded_model.model, invariance, draft_model=draft_model,
                                       draft_name="4-bit rounded copy", prefill_chunk=CHUNK, fingerprint=fingerprint)
        prefix_cache = PrefixCache(4)
        engine = Engine(embedded_model, max_active=4, deployment=deployment, prefix_cache=prefix_cache).start()
        try:
            with running(create_app(engine, fingerprint=fingerprint)) as url:
                client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
                yield SimpleNamespace(client=client, engine=engine, prefix_cache=prefix_cache, invariance=invariance,
                                      fingerprint=fingerprint, transform=transform, answers={})
        finally:
            engine.stop()
    finally:
        set_batch_invariant_limit(embedded_model.model, 0)  # other modules get the native model


@pytest.fixture(scope="module")
def answer(server):
    """Memoised deterministic answers: (prompt name, sampling name, method, k, stream, tokens)."""
    prompts = {"hello": HELLO, "story": STORY}
    samplings = {"greedy": GREEDY, "seeded": SEEDED}

    def get(prompt, sampling, method="none", k=None, stream=False, tokens=TOKENS) -> Answer:
        key = (prompt, sampling, method, k, stream, tokens)
        if key not in server.answers:
            server.answers[key] = chat(server.client, prompts[prompt], {**samplings[sampling], "max_tokens": tokens},
                                       method=method, k=k, stream=stream)
        return server.answers[key]

    return get


def assert_same(got: Answer, want: Answer):
    assert got.text == want.text
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs
    assert got.bits() == want.bits()


# ------------------------------------------------------------------ greedy, the repetitive prompt

def test_greedy_baseline_is_cold_full_length_and_guaranteed(server, answer):
    assert (server.engine.prefix_cache.hits, server.engine.prefix_cache.misses) == (0, 0)
    base = answer("hello", "greedy")
    assert (server.engine.prefix_cache.hits, server.engine.prefix_cache.misses) == (0, 1)  # computed cold
    assert len(base.tokens) == base.completion_tokens == TOKENS and base.finish_reason == "length"
    assert len(set(base.tokens)) > 2 and all(len(t) == 3 for t in base.tops)
    assert base.fingerprint == server.fingerprint
    assert base.lockstep == {"deterministic": True, "batch_invariant_limit": L, "guaranteed": True,
                             "speculative": "none", "num_draft_tokens": 0, "drafted_tokens": 0,
                             "accepted_tokens": 0, "forward_passes": TOKENS}


def test_second_identical_request_hits_the_prefix_cache_and_matches(server, answer):
    base = answer("hello", "greedy")
    hits = server.engine.prefix_cache.hits
    again = chat(server.client, HELLO, GREEDY)
    assert server.engine.prefix_cache.hits == hits + 1
    assert_same(again, base)


@pytest.mark.parametrize("method, k, tokens", [("draft", 1, DRAFTED), ("draft", 5, DRAFTED),
                                               ("prompt_lookup", 3, TOKENS)])
def test_greedy_tokens_do_not_depend_on_speculation(answer, method, k, tokens):
    base = answer("hello", "greedy", tokens=tokens)
    spec = answer("hello", "greedy", method, k, tokens=tokens)
    assert_same(spec, base)
    assert len(spec.tokens) == tokens
    ext = spec.lockstep
    assert (ext["speculative"], ext["num_draft_tokens"], ext["guaranteed"]) == (method, k, True)
    assert ext["drafted_tokens"] > 0 and ext["accepted_tokens"] > 0
    assert ext["forward_passes"] < tokens  # accepted drafts saved target passes


def test_streamed_equals_non_streamed(answer):
    base = answer("hello", "greedy")
    streamed = answer("hello", "greedy", "prompt_lookup", L - 1, stream=True)
    assert_same(streamed, base)
    assert streamed.completion_tokens == TOKENS
    assert streamed.lockstep["speculative"] == "prompt_lookup" and streamed.lockstep["accepted_tokens"] > 0


# ------------------------------------------------------------------ seeded sampling, a free-form prompt

def test_seeded_baseline_runs_full_length(answer):
    base = answer("story", "seeded")
    assert len(base.tokens) == TOKENS and base.finish_reason == "length"
    assert base.lockstep["speculative"] == "none" and base.lockstep["guaranteed"] is True


@pytest.mark.parametrize("method, k, tokens", [("draft", 3, DRAFTED), ("prompt_lookup", 1, TOKENS)])
def test_seeded_tokens_do_not_depend_on_speculation(answer, method, k, tokens):
    base = answer("story", "seeded", tokens=tokens)
    spec = answer("story", "seeded", method, k, tokens=tokens)
    assert_same(spec, base)
    assert len(spec.tokens) == tokens
    assert spec.lockstep["drafted_tokens"] > 0
    if method == "draft":  # a greedy draft against a sampled target: some rejected
        assert 0 < spec.lockstep["accepted_tokens"] < spec.lockstep["drafted_tokens"]


def test_the_seed_steers_the_sampled_tokens(server, answer):
    """The seeded comparisons above compare tokens a seed changes, so they are not equal by
    construction. It is no control for batching (it shows nothing about a batch changing a row):
    the controls that must diverge run under the shape-variant double
    (tests/test_deterministic_double.py, e.g. test_speculative_differs_from_plain_without_the_limit)."""
    base = answer("story", "seeded")
    other = chat(server.client, STORY, {**SEEDED, "seed": 99, "max_tokens": 16})
    assert other.tokens != base.tokens[:16]


# ------------------------------------------------------------------ beside other requests

class ActiveAtPasses:
    """An engine observer: how many requests were active at each decode pass."""

    def __init__(self, engine):
        self.engine, self.seen = engine, [0]

    def on_pass(self, rows, members):
        self.seen.append(self.engine.counts()["active"])


def test_concurrent_with_other_requests_equals_alone(server, answer):
    base = answer("hello", "greedy", tokens=DRAFTED)
    results, errors = {}, []
    start = threading.Barrier(3)

    def run(name, fn):
        try:
            start.wait()
            results[name] = fn()
        except Exception as exc:  # reported below, never swallowed
            errors.append((name, exc))

    loose = dict(temperature=1.0, max_tokens=24)
    jobs = {
        "main": lambda: chat(server.client, HELLO, {**GREEDY, "max_tokens": DRAFTED}, method="draft", k=3),
        "other": lambda: server.client.chat.completions.create(model="default", messages=OTHER, **loose),
        "story": lambda: server.client.chat.completions.create(  # non-deterministic: k may exceed L - 1
            model="default", messages=STORY, extra_body={"speculative": "prompt_lookup", "num_draft_tokens": 8},
            **loose),
    }
    active_at_passes = ActiveAtPasses(server.engine)
    server.engine.observers.append(active_at_passes)
    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        server.engine.observers.remove(active_at_passes)
    assert not errors, errors
    most_active = max(active_at_passes.seen)
    assert most_active >= 2  # they really shared the engine
    assert_same(results["main"], base)
    assert results["main"].lockstep["speculative"] == "draft"
    assert results["story"].model_extra["lockstep"]["deterministic"] is False


# ------------------------------------------------------------------ refusals

def test_refusals_name_the_parameter(server):
    def refused(messages, sampling, **kwargs):
        with pytest.raises(BadRequestError) as info:
            chat(server.client, messages, sampling, **kwargs)
        assert info.value.status_code == 400
        return info.value.param

    short = {**GREEDY, "max_tokens": 2}
    assert refused(HELLO, short, method="prompt_lookup", k=L) == "num_draft_tokens"
    assert refused(HELLO, short, method="draft", k=L + 3) == "num_draft_tokens"
    # control: the same k without `deterministic`
    assert chat(server.client, HELLO, short, method="prompt_lookup", k=L, deterministic=False).completion_tokens == 2


@pytest.fixture(scope="module")
def l0_server(server, embedded_model):
    """A deployment with L = 0 and no draft model (same engine code, own prefix cache)."""
    from lockstep.server.api.app import create_app
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine import Engine
    from lockstep.server.engine.cache.prefix_cache import PrefixCache

    engine = Engine(embedded_model, max_active=4, deployment=Deployment(prefill_chunk=CHUNK),
                    prefix_cache=PrefixCache(2)).start()
    try:
        with running(create_app(engine, fingerprint="fp_l0")) as url:
            yield OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    finally:
        engine.stop()


def test_limit_zero_runs_deterministic_requests_plain_with_a_note(l0_server):
    got = chat(l0_server, HELLO, {**GREEDY, "max_tokens": 6}, method="prompt_lookup", k=3)
    ext = got.lockstep
    assert (ext["deterministic"], ext["batch_invariant_limit"], ext["guaranteed"]) == (True, 0, False)
    assert (ext["speculative"], ext["num_draft_tokens"], ext["drafted_tokens"]) == ("none", 0, 0)
    assert ext["forward_passes"] == 6 and "without speculation, in passes of its own" in ext["note"]
    assert got.fingerprint == "fp_l0"
    with pytest.raises(BadRequestError) as info:  # no draft model on this server
        chat(l0_server, HELLO, {**GREEDY, "max_tokens": 2}, method="draft", k=2)
    assert info.value.param == "speculative"


# ------------------------------------------------------------------ a server restart (last: it waited)

def test_a_restarted_server_gives_the_same_bits(server, answer, restarted):
    base = answer("hello", "greedy")
    wait_for_health(restarted.proc, restarted.url, restarted.log, timeout=240)  # proven after it serves
    with httpx.Client(base_url=restarted.url, timeout=5) as http:
        info = http.get("/v1/models").json()["data"][0]["lockstep"]
    assert info["batch_invariance"]["limit"] == L and info["batch_invariance"]["guaranteed"] is True
    assert info["batch_invariance"]["strategy"] == server.invariance.strategy
    assert info["transform"] == server.transform  # same weights, no audit workaround
    client = OpenAI(base_url=restarted.url + "/v1", api_key="x", max_retries=0, timeout=600)
    fresh = chat(client, HELLO, GREEDY)
    assert fresh.fingerprint == server.fingerprint
    assert_same(fresh, base)
    assert fresh.lockstep == base.lockstep
    # what a receipt says of the request and its answer is the same after a restart
    same = ("prompt", "answer", "answer_tokens", "logprobs", "sampling", "seed", "batch_invariant_limit", "guaranteed")
    assert {k: fresh.receipt[k] for k in same} == {k: base.receipt[k] for k in same}
