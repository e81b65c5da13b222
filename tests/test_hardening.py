"""The HTTP service's guards: API keys, request limits, metrics, access log, draining.

The engine here runs a scripted generator (no MLX work), so limits and queueing can be
driven exactly: `ScriptedGenerate.gate` holds the worker to fill the queue on demand.
"""
import argparse
import json
import logging
import threading

import httpx2 as httpx
import pytest
from openai import AuthenticationError, OpenAI

from lockstep.server.api.errors import RETRY_AFTER_S
from lockstep.server.engine.generate import Delta
from lockstep.server.engine.decoding.request_report import RequestReport
from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import running, wait_until

KEYS = ["key-one", "key-two"]
GOOD = {"Authorization": "Bearer key-two"}
PROMPT_TEXT = "my secret prompt about zebras"
CHAT = {"model": "default", "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 3}
ERROR_KEYS = {"message", "type", "param", "code"}
REPORT = RequestReport(speculative="prompt_lookup", drafted_tokens=5, accepted_tokens=3, deterministic=True)


class ScriptedGenerate:
    """Stands in for server.engine.generate.generate: `max_tokens` tokens "t0 t1 ...", then "length"."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.max_tokens_seen = []

    def __call__(self, loaded, request, **_):
        self.max_tokens_seen.append(request.max_tokens)
        n = len(request.prompt_tokens)
        for i in range(request.max_tokens):
            while not self.gate.wait(0.01):
                yield None  # let the engine notice cancellation while held
            last = i == request.max_tokens - 1
            yield Delta(text=f"t{i} ", prompt_tokens=n, completion_tokens=i + 1,
                        finish_reason="length" if last else None, report=REPORT if last else None)


@pytest.fixture(scope="module")
def scripted():
    return ScriptedGenerate()


@pytest.fixture(scope="module")
def hardened(embedded_model, scripted):
    """(base URL, app) for an app with keys, small limits and one slot."""
    from lockstep.server.api.app import create_app
    from lockstep.server.api.limits import Limits

    engine = ScriptedEngine(embedded_model, scripted, max_active=1).start()
    limits = Limits(max_body_bytes=4096, max_tokens=16, max_prompt_tokens=64, max_queue=1, max_prediction_tokens=32)
    app = create_app(engine, api_keys=KEYS, limits=limits)
    try:
        with running(app) as url:
            yield url, app
    finally:
        scripted.gate.set()
        engine.stop()


@pytest.fixture
def http(hardened):
    with httpx.Client(base_url=hardened[0], timeout=60) as client:
        yield client


def assert_error(response, status, code=None, param=None, type="invalid_request_error"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    assert (error["type"], error["code"], error["param"]) == (type, code, param)
    return error


# ------------------------------------------------------------------------------ auth

def test_missing_key_is_401_in_the_openai_shape(http):
    response = http.post("/v1/chat/completions", json=CHAT)
    assert_error(response, 401)
    assert response.headers["www-authenticate"] == "Bearer"
    assert "API key" in response.json()["error"]["message"]


@pytest.mark.parametrize("header", ["Bearer key-three", "Bearer key-on", "Bearer key-one-and-more",
                                    "Basic key-one", "key-one"])
def test_wrong_or_malformed_key_is_401(http, header):
    response = http.get("/v1/models", headers={"Authorization": header})
    code = "invalid_api_key" if header.startswith("Bearer") else None
    assert_error(response, 401, code=code)


def test_every_configured_key_passes(http):
    for key in KEYS:
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    response = http.post("/v1/chat/completions", json=CHAT, headers=GOOD)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "t0 t1 t2 "


def test_health_is_open_and_metrics_and_unknown_v1_paths_are_not(http):
    assert http.get("/health").json()["status"] == "ok"
    assert_error(http.get("/metrics"), 401)
    assert_error(http.get("/v1/no-such-route"), 401)  # no probing of routes without a key
    assert http.get("/metrics", headers=GOOD).status_code == 200


def test_the_openai_client_sees_an_authentication_error(hardened):
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=hardened[0] + "/v1", api_key="wrong", max_retries=0).models.list()
    models = OpenAI(base_url=hardened[0] + "/v1", api_key="key-one", max_retries=0).models.list()
    assert [m.id.endswith(":deterministic") for m in models.data] == [False, True]


def test_keys_come_from_flags_and_the_environment():
    from lockstep.server.api.auth import api_keys

    assert api_keys(["a", " b "], environ={"LOCKSTEP_API_KEYS": "c, ,d"}) == ["a", "b", "c", "d"]
    assert api_keys([], environ={}) == []


# ---------------------------------------------------------------------------- binding

def _serve_args(*argv):
    from lockstep.server.commands.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_binding_beyond_loopback_without_a_key_warns(caplog, monkeypatch):
    from lockstep.server.commands.http_args import http_settings_from_args

    monkeypatch.delenv("LOCKSTEP_API_KEYS", raising=False)
    assert _serve_args().host == "127.0.0.1"
    cases = [((), False), (("--host", "0.0.0.0"), True), (("--host", "::"), True),
             (("--host", "example.org"), True), (("--host", "0.0.0.0", "--api-key", "k"), False),
             (("--host", "::1"), False), (("--host", "localhost"), False)]
    for argv, warns in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lockstep.auth"):
            settings = http_settings_from_args(_serve_args(*argv))
        assert any("without an API key" in r.getMessage() for r in caplog.records) == warns, argv
    assert settings["api_keys"] == []


def test_limit_flags_reach_the_settings(monkeypatch):
    from lockstep.server.commands.http_args import http_settings_from_args

    monkeypatch.setenv("LOCKSTEP_API_KEYS", "from-env")
    args = _serve_args("--api-key", "k1", "--api-key", "k2", "--max-body-bytes", "100", "--max-tokens-limit", "7",
                       "--max-prompt-tokens", "50", "--max-queue", "0", "--log-prompts", "--drain-timeout", "5",
                       "--grammar-workers", "3", "--grammar-queue", "0", "--max-prediction-tokens", "9")
    settings = http_settings_from_args(args)
    assert settings["api_keys"] == ["k1", "k2", "from-env"] and settings["log_prompts"] is True
    limits = settings["limits"]
    assert (limits.max_body_bytes, limits.max_tokens, limits.max_prompt_tokens, limits.max_queue) == (100, 7, 50, 0)
    assert (limits.grammar_workers, limits.grammar_queue) == (3, 0)
    assert limits.max_prediction_tokens == 9
    assert args.drain_timeout == 5.0
    for refused in (("--max-tokens-limit", "0"), ("--grammar-workers", "0"), ("--grammar-queue", "-1")):
        with pytest.raises(SystemExit):
            _serve_args(*refused)


# ----------------------------------------------------------------------------- limits

def test_declared_body_over_the_limit_is_413(http):
    body = json.dumps({**CHAT, "user": "x" * 5000})
    response = http.post("/v1/chat/completions", content=body, headers={**GOOD, "content-type": "application/json"})
    assert_error(response, 413, code="request_too_large")


def test_streamed_body_over_the_limit_is_413_without_a_length(http):
    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        yield b'{"model": "default", "user": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    response = http.post("/v1/chat/completions", content=chunks(), headers={**GOOD, "content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, code="request_too_large")


def test_streamed_body_under_the_limit_is_served(http):
    def chunks():
        body = json.dumps(CHAT).encode()
        yield body[:10]
        yield body[10:]

    response = http.post("/v1/chat/completions", content=chunks(), headers={**GOOD, "content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_malformed_content_length_is_400(hardened):
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(hardened[0])
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n"
                  b"Content-Length: -5\r\n\r\n")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_cap_is_400(http, scripted, field):
    body = {**CHAT, field: 17}
    body.pop("max_tokens") if field != "max_tokens" else None
    assert_error(http.post("/v1/chat/completions", json=body, headers=GOOD), 400, param=field)
    assert http.post("/v1/chat/completions", json={**body, field: 16}, headers=GOOD).status_code == 200
    assert scripted.max_tokens_seen[-1] == 16


def test_the_cap_is_the_default_max_tokens(http, scripted):
    body = {"model": "default", "prompt": "hello"}
    assert http.post("/v1/completions", json=body, headers=GOOD).json()["usage"]["completion_tokens"] == 16
    assert scripted.max_tokens_seen[-1] == 16


def test_prompt_over_the_cap_is_400(http):
    body = {"model": "default", "prompt": [5] * 65, "max_tokens": 1}
    assert_error(http.post("/v1/completions", json=body, headers=GOOD), 400, code="prompt_too_long", param="prompt")
    assert http.post("/v1/completions", json={**body, "prompt": [5] * 64}, headers=GOOD).status_code == 200


def test_a_prediction_over_the_cap_is_400_for_the_openai_client(hardened, embedded_model):
    """Issue 49, finding 3: a ~1 MB prediction was indexed and followed whole. A prediction of
    more tokens than --max-prediction-tokens (32 here) is refused before it reaches the engine."""
    from openai import BadRequestError

    client = OpenAI(base_url=hardened[0] + "/v1", api_key="key-one", max_retries=0)
    words = " ".join(f"w{i}" for i in range(40))
    tokens = embedded_model.tokenizer.encode(words, add_special_tokens=False)
    assert len(tokens) > 32
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model="default", messages=CHAT["messages"], max_tokens=3,
                                       prediction={"type": "content", "content": words})
    error = refused.value.body
    assert (error["param"], error["code"], error["type"]) == ("prediction", "prediction_too_long",
                                                              "invalid_request_error")
    assert f"{len(tokens)} tokens" in error["message"] and "at most 32" in error["message"]
    fits = embedded_model.tokenizer.decode(tokens[:32])
    assert len(embedded_model.tokenizer.encode(fits, add_special_tokens=False)) <= 32
    answer = client.chat.completions.create(model="default", messages=CHAT["messages"], max_tokens=3,
                                            prediction={"type": "content", "content": fits})
    assert answer.usage.completion_tokens == 3


def test_a_full_queue_is_429_and_the_queue_recovers(hardened, http, scripted):
    """One slot, queue cap 1: one request runs (held), one waits, the next is refused."""
    results = {}

    def post(name):
        with httpx.Client(base_url=hardened[0], timeout=60) as c:
            results[name] = c.post("/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2},
                                   headers=GOOD)

    scripted.gate.clear()
    threads = []
    try:
        for name, state in (("running", "active"), ("waiting", "waiting")):
            threads.append(threading.Thread(target=post, args=(name,)))
            threads[-1].start()
            wait_until(lambda: http.get("/health").json()[state] == 1, what=f"a {state} request")
        refused = http.post("/v1/completions", json={"model": "default", "prompt": "hi"}, headers=GOOD)
        assert_error(refused, 429, code="rate_limit_exceeded", type="requests")
        assert refused.headers["retry-after"] == str(RETRY_AFTER_S)  # else the openai SDK backs off blindly
        gauge = http.get("/metrics", headers=GOOD).text
        assert "lockstep_queue_depth 1.0" in gauge and "lockstep_active_requests 1.0" in gauge
    finally:
        scripted.gate.set()
        for t in threads:
            t.join(timeout=60)
    assert results["running"].status_code == results["waiting"].status_code == 200
    assert http.post("/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 1},
                     headers=GOOD).status_code == 200


# ------------------------------------------------------------------------ disconnects

def test_a_non_streamed_request_whose_client_left_is_cancelled(hardened, http, scripted):
    cancelled = http.get("/health").json()["cancelled"]
    scripted.gate.clear()  # the generation cannot finish by itself
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(hardened[0] + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 4},
                       headers=GOOD, timeout=httpx.Timeout(60, read=0.5))
        wait_until(lambda: http.get("/health").json()["cancelled"] == cancelled + 1, what="the cancellation")
        assert http.get("/health").json()["active"] == 0
    finally:
        scripted.gate.set()


# ---------------------------------------------------------------------------- metrics

def _sample(text, name, **labels):
    """The value of one sample in Prometheus exposition text (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_requests_errors_tokens_and_extensions(hardened, http):
    before = http.get("/metrics", headers=GOOD).text
    assert http.post("/v1/chat/completions", json=CHAT, headers=GOOD).status_code == 200
    stream = http.post("/v1/completions", json={"model": "default", "prompt": [5, 6], "max_tokens": 2, "stream": True},
                       headers=GOOD)
    assert stream.text.rstrip().endswith("data: [DONE]")
    http.post("/v1/chat/completions", json=CHAT)  # 401
    http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 99}, headers=GOOD)  # 400
    http.get("/v1/not-a-route", headers=GOOD)  # 404
    after = http.get("/metrics", headers=GOOD)
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text

    def delta(name, **labels):
        return _sample(text, name, **labels) - _sample(before, name, **labels)

    assert delta("lockstep_http_requests_total", endpoint="/v1/chat/completions") == 3
    assert delta("lockstep_http_requests_total", endpoint="/v1/completions") == 1
    assert delta("lockstep_http_requests_total", endpoint="other") == 1
    assert delta("lockstep_http_errors_total", endpoint="/v1/chat/completions", status="401") == 1
    assert delta("lockstep_http_errors_total", endpoint="/v1/chat/completions", status="400") == 1
    assert delta("lockstep_http_errors_total", endpoint="other", status="404") == 1
    assert delta("lockstep_completion_tokens_total") == 3 + 2
    assert delta("lockstep_prompt_tokens_total") > 2  # the chat template's tokens + 2 ids
    assert delta("lockstep_time_to_first_token_seconds_count") == 2
    assert delta("lockstep_decode_tokens_per_second_count") == 2
    assert delta("lockstep_speculative_drafted_tokens_total") == 2 * REPORT.drafted_tokens
    assert delta("lockstep_speculative_accepted_tokens_total") == 2 * REPORT.accepted_tokens
    assert delta("lockstep_deterministic_requests_total") == 2
    assert "lockstep_queue_depth 0.0" in text


def test_each_app_has_its_own_registry(embedded_model, scripted):
    from lockstep.server.api.app import create_app

    engine = ScriptedEngine(embedded_model, scripted)  # never started: no request reaches it
    first, second = create_app(engine), create_app(engine)
    assert first is not second  # two apps on one process: no duplicate-metric error


# ------------------------------------------------------------------------- access log

def _access_lines(caplog):
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "lockstep.access"]


def test_access_log_is_one_json_line_without_the_prompt(http, caplog):
    with caplog.at_level(logging.INFO, logger="lockstep.access"):
        response = http.post("/v1/chat/completions", json=CHAT, headers={**GOOD, "x-request-id": "req-123"})
        http.post("/v1/chat/completions", json=CHAT)  # 401
        # a record reaches its sinks once its response is sent: the client may read it first
        wait_until(lambda: len(_access_lines(caplog)) >= 2, timeout=10, what="both access lines")
    assert response.headers["x-request-id"] == "req-123"
    lines = _access_lines(caplog)
    assert len(lines) == 2
    ok, denied = lines
    assert ok["request_id"] == "req-123" and ok["method"] == "POST" and ok["path"] == "/v1/chat/completions"
    assert ok["status"] == 200 and ok["completion_tokens"] == 3 and ok["prompt_tokens"] > 5
    assert ok["duration_s"] >= 0 and ok["finish_reason"] == "length"
    assert denied["status"] == 401 and denied["prompt_tokens"] is None and len(denied["request_id"]) == 32
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "zebras" not in logged


def test_prompts_are_logged_only_when_asked(embedded_model, scripted, caplog):
    from fastapi.testclient import TestClient

    from lockstep.server.api.app import create_app

    engine = ScriptedEngine(embedded_model, scripted).start()
    try:
        with TestClient(create_app(engine, log_prompts=True)) as client, \
                caplog.at_level(logging.INFO, logger="lockstep.access"):
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        engine.stop()
    (line,) = _access_lines(caplog)
    assert "zebras" in json.dumps(line["prompt"])


# ------------------------------------------------------------------------------ drain

def test_draining_refuses_new_work_with_503(embedded_model, scripted):
    from fastapi.testclient import TestClient

    from lockstep.server.api.app import create_app

    engine = ScriptedEngine(embedded_model, scripted)  # not started: refused before it matters
    app = create_app(engine)
    app.state.drain.start()
    with TestClient(app) as client:
        refused = client.post("/v1/chat/completions", json=CHAT)
        assert_error(refused, 503, code="server_shutting_down", type="server_error")
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert refused.headers["retry-after"] == health.headers["retry-after"] == str(RETRY_AFTER_S)


def test_a_failed_deployment_503_carries_retry_after(embedded_model, scripted):
    """The distributed gate answers outside the app's middleware: it must add Retry-After itself."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from lockstep.server.api.app import create_app
    from lockstep.server.distributed.startup import gate_on_health

    app = create_app(ScriptedEngine(embedded_model, scripted))  # not started: refused before it matters
    gate_on_health(app, SimpleNamespace(failed="rank 1 exited"))
    with TestClient(app) as client:
        for response in (client.get("/health"), client.post("/v1/chat/completions", json=CHAT)):
            assert_error(response, 503, code="deployment_failed", type="server_error")
            assert response.headers["retry-after"] == str(RETRY_AFTER_S)


def test_async_eval_layers_reach_the_deployment_and_bad_values_are_refused():
    from lockstep.server.commands.runtime_args import options_from_args
    from lockstep.server.commands.serve import check_engine_arguments

    assert options_from_args(_serve_args()).async_eval_layers == 0
    args = _serve_args("--async-eval-layers", "6")
    check_engine_arguments(args)
    assert options_from_args(args).async_eval_layers == 6
    with pytest.raises(ValueError, match="must be >= 0"):
        check_engine_arguments(_serve_args("--async-eval-layers", "-1"))
    with pytest.raises(ValueError, match="--parallel"):
        check_engine_arguments(_serve_args("--async-eval-layers", "6", "--parallel", "pipeline"))
