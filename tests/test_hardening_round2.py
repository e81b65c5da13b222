"""Regression tests for the second adversarial probe: each test names the finding it guards.

Most run against an app whose engine steps a scripted generator (no MLX work), so stalls,
drains and disconnects can be driven exactly; the sampling and speculation findings run on
the embedded model.
"""
import json
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import mlx.core as mx
import pytest

from lockstep.server.engine.generate import Delta
from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import running, wait_until

KEYS = ["k1"]
AUTH = {"Authorization": "Bearer k1"}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class EndlessGenerate:
    """Emits a token every 50 ms while `gate` is open (never while it is closed), up to max_tokens."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, loaded, request, **_):
        n = len(request.prompt_tokens)
        for i in range(1, request.max_tokens + 1):
            while not self.gate.wait(0.01):
                yield None
            time.sleep(0.05)
            yield Delta(text=f"t{i} ", prompt_tokens=n, completion_tokens=i,
                        finish_reason="length" if i == request.max_tokens else None)


@pytest.fixture(scope="module")
def endless():
    return EndlessGenerate()


@pytest.fixture(scope="module")
def app_url(embedded_model, endless):
    from lockstep.server.api.app import create_app

    engine = ScriptedEngine(embedded_model, endless, max_active=4).start()
    app = create_app(engine, api_keys=KEYS)
    try:
        with running(app) as url:
            yield url, app, engine
    finally:
        endless.gate.set()
        engine.stop()


@pytest.fixture
def http(app_url):
    with httpx.Client(base_url=app_url[0], timeout=60, headers=AUTH) as client:
        yield client


def error_of(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ------------------------------------------------- 1. a request that stalls all others

def test_draft_tokens_above_the_server_maximum_are_refused_naming_the_limit(http):
    from lockstep.server.engine.guarantee.deployment import MAX_DRAFT_TOKENS

    body = {**CHAT, "speculative": "prompt_lookup", "num_draft_tokens": 300, "max_tokens": 1}
    message = error_of(http.post("/v1/chat/completions", json=body), 400, "num_draft_tokens")
    assert f"at most {MAX_DRAFT_TOKENS}" in message
    ok = {**body, "num_draft_tokens": MAX_DRAFT_TOKENS}
    assert http.post("/v1/chat/completions", json=ok).status_code == 200


def test_the_num_draft_tokens_flag_is_bounded_by_the_maximum():
    from lockstep.server.runtime import Options, build_runtime

    with pytest.raises(ValueError, match="above --max-draft-tokens"):
        build_runtime(Options(num_draft_tokens=300))  # refused before any model is loaded
    with pytest.raises(ValueError, match="--max-draft-tokens must be >= 1"):
        build_runtime(Options(max_draft_tokens=0))


def test_drafts_are_clipped_to_the_tokens_left(embedded_model, monkeypatch):
    from lockstep.server.engine.guarantee.decode_plan import DecodePlan
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine.generate import GenerationRequest, generate
    from lockstep.server.engine.decoding.sampling import SamplingParams
    from lockstep.server.engine.decoding.drafters import PromptLookupDrafter

    asked = []
    original = PromptLookupDrafter.propose

    def recording(self, context, k, cancelled=None):
        asked.append(k)
        return original(self, context, k)

    monkeypatch.setattr(PromptLookupDrafter, "propose", recording)
    prompt = list(embedded_model.tokenizer.encode("one two three one two three one two three one two"))
    request = GenerationRequest(prompt, max_tokens=3, sampling=SamplingParams(temperature=0.0))
    plan = DecodePlan("none", "prompt_lookup", 8)
    # fixed k (no back-off): the first step asks for what is left
    deltas = [d for d in generate(embedded_model, request, plan=plan, deployment=Deployment(draft_backoff=False)) if d]
    assert deltas[-1].completion_tokens <= 3
    assert asked and asked[0] == 2  # 3 tokens left: 2 drafts + the target's own token
    assert all(k <= 2 for k in asked)
    # with the back-off (the default) neither verified nor shadow drafts go past the tokens left
    asked.clear()
    deltas = [d for d in generate(embedded_model, request, plan=plan, deployment=Deployment()) if d]
    assert deltas[-1].completion_tokens <= 3
    assert asked and all(k <= 2 for k in asked)


def test_a_cancelled_request_stops_drafting_inside_the_step(embedded_model):
    from lockstep.server.engine.decoding.drafters import DraftModelDrafter

    drafter = DraftModelDrafter(embedded_model.model)
    feeds = []
    original = drafter._feed

    def counting_feed(tokens):
        feeds.append(len(tokens))
        return original(tokens)

    drafter._feed = counting_feed
    context = list(embedded_model.tokenizer.encode("Once upon a time"))
    gone = threading.Event()

    def cancelled():
        gone.set()  # the client leaves as soon as the first draft pass is done
        return True

    drafts = drafter.propose(context, 100, cancelled)
    assert gone.is_set()
    assert len(feeds) == 1 and len(drafts) == 1  # one pass, not 100


def test_a_long_step_does_not_hold_the_engine_after_its_client_left(embedded_model):
    """The engine passes `cancelled` to generate, and a cancelled request leaves at once."""

    seen = {}

    def long_step_generate(loaded, request, *, cancelled, **_):
        seen["cancelled"] = cancelled
        while not cancelled():  # a step that polls cancellation, like a drafter does
            yield None

    engine = ScriptedEngine(embedded_model, long_step_generate).start()
    try:
        import asyncio

        async def go():
            from lockstep.server.engine.generate import GenerationRequest

            handle = engine.submit(GenerationRequest([1, 2], max_tokens=4))
            await asyncio.to_thread(wait_until, lambda: "cancelled" in seen)
            handle.cancel()
            await asyncio.to_thread(wait_until, lambda: engine.counts()["active"] == 0)

        asyncio.run(go())
        assert engine.counts()["cancelled"] == 1
    finally:
        engine.stop()


# ------------------------------------------------ 2. tiny temperature or top_p

@pytest.mark.parametrize("params", [dict(temperature=1e-40), dict(temperature=1e-300),
                                    dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_p=1e-45)])
def test_tiny_temperature_or_top_p_picks_the_top_token(params):
    from lockstep.server.engine.decoding.sampling import SamplingParams, sample

    logits = mx.random.normal((3, 1000), key=mx.random.key(3)) * 4
    chosen = sample(logits, [10, 11, 12], SamplingParams(seed=5, top_logprobs=1, **params))
    assert [c.token for c in chosen] == mx.argmax(logits, axis=-1).tolist()
    assert all(c.logprob is not None and c.logprob == c.logprob for c in chosen)  # not NaN


def test_tiny_temperature_over_http_answers_like_greedy(live_server):
    from openai import OpenAI

    client = OpenAI(base_url=live_server, api_key="unused")
    messages = [{"role": "user", "content": "Name a color."}]
    greedy = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0)
    tiny = client.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=1e-300)
    assert tiny.choices[0].message.content and tiny.choices[0].message.content == greedy.choices[0].message.content


# ------------------------------------------------------------------ 3. seeds

@pytest.mark.parametrize("seed", [2**63, 2**64, 2**200, 10**4000, -(2**63) - 1])
def test_seeds_outside_int64_are_refused(http, seed):
    body = json.dumps({**CHAT, "seed": seed})
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error_of(response, 400, "seed")


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), -1, 0])
def test_seeds_inside_int64_are_accepted(http, seed):
    assert http.post("/v1/chat/completions", json={**CHAT, "seed": seed}).status_code == 200


def test_distinct_int64_seeds_give_distinct_keys():
    from lockstep.server.engine.decoding.sampling import key_for

    keys = {tuple(key_for(seed, 7).tolist()) for seed in (0, -1, 2**63 - 1, -(2**63), 1)}
    assert len(keys) == 5


# ------------------------------------------------- 4. streams cut at the drain timeout
# tests/test_drain_cutoff.py

# ----------------------------------------- 5. the cancelled metric and /health agree

def _metric(http, name):
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing")


def test_non_streamed_disconnects_move_the_metric_and_health_together(app_url, http, endless):
    before = http.get("/health").json()["cancelled"]
    assert _metric(http, "lockstep_cancelled_requests_total") == before
    endless.gate.clear()
    try:
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(app_url[0] + "/v1/completions", json={"model": "default", "prompt": "hi"},
                           headers=AUTH, timeout=httpx.Timeout(60, read=0.3))
        wait_until(lambda: http.get("/health").json()["cancelled"] == before + 3, what="three cancellations")
    finally:
        endless.gate.set()
    assert _metric(http, "lockstep_cancelled_requests_total") == before + 3


# ------------------------------------------------ 6. orphaned import directories

def test_stale_import_directories_are_swept(tmp_path):
    from lockstep.models.gguf_import import sweep_stale_imports

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f".SmolLM2.Q4_1-abc-q4.{dead.pid}.x1y2.tmp"
    live = tmp_path / f".SmolLM2.Q4_1-abc-q4.{__import__('os').getpid() - 0}.z9.tmp"
    for d in (orphan, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"0" * 1000)
    model = tmp_path / "SmolLM2.Q4_1-abc-q4"
    model.mkdir()
    assert sweep_stale_imports(tmp_path) == [orphan]
    assert not orphan.exists() and live.exists() and model.exists()


def test_an_import_sweeps_before_it_looks_in_the_cache(tmp_path, monkeypatch):
    from lockstep.models import gguf_import
    from lockstep.models.embedded import embedded_gguf_path
    from lockstep.models.gguf_import import imported_dir, import_gguf

    final = imported_dir(embedded_gguf_path(), "q4", tmp_path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_import, "damage", lambda directory: None)  # a cache hit: no import work
    orphan = tmp_path / f".{final.name}.999999999.abc.tmp"
    orphan.mkdir()
    assert import_gguf(embedded_gguf_path(), "q4", cache_root=tmp_path, progress=False) == final
    assert not orphan.exists()


# ----------------------------------------------------- 7. a port already in use

def test_a_busy_port_is_reported_before_the_model_loads():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        done = subprocess.run([sys.executable, "-m", "lockstep.server.cli", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in done.stderr and "in use" in done.stderr
    assert "serving" not in done.stderr and "loaded" not in done.stderr.lower()


def test_a_port_taken_while_the_model_loaded_is_said_in_one_line(embedded_model, endless, caplog):
    """Two servers started together both bind (SO_REUSEADDR, neither listening yet); the one
    that listens second must say so plainly and exit 1, not raise uvicorn's traceback."""
    import argparse

    from lockstep.server.api import shutdown
    from lockstep.server.api.app import create_app
    from lockstep.server.commands.serve import _serve_http

    sock = shutdown.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    other = shutdown.bind("127.0.0.1", port)  # the other server, bound during this one's load
    other.listen()
    engine = ScriptedEngine(embedded_model, endless)  # never started
    args = argparse.Namespace(host="127.0.0.1", port=port, drain_timeout=1.0)
    try:
        with caplog.at_level("ERROR", logger="lockstep.serve"):
            assert _serve_http(args, create_app(engine), engine, sock) is False
    finally:
        other.close()
        sock.close()
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text and "choose another --port" in caplog.text


# ----------------------------------------------------------- 8. error messages

@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 1000}, "stop", "at most 4 stop sequences"),
    ("/v1/completions", {"model": "default", "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages", "only text content"),
])
def test_rule_violations_are_named_plainly(http, path, body, param, words):
    message = error_of(http.post(path, json=body), 400, param)
    assert words in message and "valid string" not in message


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model":"default","messages":[{"role":"user","content":"a\\ud800b"}]}', "messages"),
    ("/v1/completions", '{"model":"default","prompt":"\\udfff"}', "prompt"),
])
def test_a_lone_surrogate_is_refused_plainly(http, path, body, param):
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    message = error_of(response, 400, param)
    assert "lone surrogate" in message and "TextEncodeInput" not in message


# ------------------------------------------------------------- 9. strict types

@pytest.mark.parametrize("field, value", [("max_tokens", "4"), ("max_tokens", True), ("max_tokens", 1e3),
                                          ("stream", "yes"), ("deterministic", "yes"), ("seed", "7"),
                                          ("temperature", "0.5")])
def test_wrongly_typed_fields_are_400_naming_the_field(http, field, value):
    error_of(http.post("/v1/chat/completions", json={**CHAT, field: value}), 400, field)


def test_integers_are_still_fine_where_numbers_are_expected(http):
    assert http.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "top_p": 1}).status_code == 200


# ------------------------------------------------------ 10. small service details

def test_head_health_is_200(app_url):
    assert httpx.head(app_url[0] + "/health").status_code == 200


def test_openapi_schema_needs_the_key_when_keys_are_set(app_url):
    assert httpx.get(app_url[0] + "/openapi.json").status_code == 401
    assert httpx.get(app_url[0] + "/openapi.json", headers=AUTH).status_code == 200


def test_the_cpu_takes_a_long_history_by_default_and_the_flag_caps_it(monkeypatch):
    """Agents send long conversations: without --max-prompt-tokens a prompt may fill the
    model's context on the CPU too (it was capped at 2,048 tokens there)."""
    import argparse

    from lockstep.server.commands.http_args import add_http_arguments, http_settings_from_args

    monkeypatch.delenv("LOCKSTEP_API_KEYS", raising=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    add_http_arguments(parser)
    assert mx.default_device() == mx.cpu  # CI's backend
    assert http_settings_from_args(parser.parse_args([]))["limits"].max_prompt_tokens is None
    settings = http_settings_from_args(parser.parse_args(["--max-prompt-tokens", "7000"]))
    assert settings["limits"].max_prompt_tokens == 7000


def test_a_cancelled_prefill_stops_at_the_next_chunk(embedded_model, monkeypatch):
    """Each prompt chunk is one engine step, so a disconnect frees the slot after one chunk."""
    import asyncio

    import lockstep.server.engine.runner.model_runner as model_runner
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.deployment import Deployment
    from lockstep.server.engine.decoding.request_state import GenerationRequest

    chunks = []
    release = threading.Event()
    original = model_runner.prompt_forward

    def counting_chunk(model, cache, tokens):
        chunks.append(len(tokens))
        if len(chunks) == 1:
            release.wait(30)  # hold the first chunk until the client has left
        return original(model, cache, tokens)

    monkeypatch.setattr(model_runner, "prompt_forward", counting_chunk)
    engine = Engine(embedded_model, deployment=Deployment(prefill_chunk=16)).start()
    try:
        async def go():
            handle = engine.submit(GenerationRequest(list(range(100, 180)), max_tokens=4))
            await asyncio.to_thread(wait_until, lambda: len(chunks) == 1)
            handle.cancel()
            release.set()
            await asyncio.to_thread(wait_until, lambda: engine.counts()["active"] == 0)

        asyncio.run(go())
    finally:
        engine.stop()
    assert chunks == [16]  # 79 prompt tokens = 5 chunks; only the first ran
    assert engine.counts()["cancelled"] == 1
