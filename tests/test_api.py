"""The HTTP API on a live uvicorn, driven by the official `openai` client.

Error cases use raw HTTP through httpx2 (the openai client's own HTTP library).
"""
import json
import threading

import httpx2 as httpx
import pytest
from openai import NotFoundError, OpenAI

from tests.http_server import wait_until

GREETING = [{"role": "user", "content": "Write a short poem about the sea."}]
ARITHMETIC = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client(live_server):
    return OpenAI(base_url=live_server, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as c:
        yield c


def chat(client, messages=GREETING, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="default", messages=messages, **kwargs)


def streamed_chat(client, messages=GREETING, **kwargs):
    chunks = list(chat(client, messages, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, text, finish


def test_chat_streamed_equals_non_streamed_for_greedy(client, embedded_model):
    full = chat(client)
    assert full.object == "chat.completion" and full.model == embedded_model.name  # alias resolved
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    chunks, text, finish = streamed_chat(client)
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_completions_streamed_equals_non_streamed(client, embedded_model):
    args = dict(model=embedded_model.name, prompt="The capital of France is", max_tokens=10, temperature=0)
    full = client.completions.create(**args)
    assert full.object == "text_completion" and full.choices[0].text
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"


def test_length_finish_and_usage_counts(client, embedded_model):
    response = chat(client, max_tokens=5)
    prompt = embedded_model.tokenizer.apply_chat_template(GREETING, add_generation_prompt=True)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.total_tokens == len(prompt) + 5
    assert chat(client, max_completion_tokens=3).usage.completion_tokens == 3


def test_end_of_turn_token_finishes_with_stop(client):
    response = chat(client, ARITHMETIC, max_tokens=16)
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 16
    assert "<|im_end|>" not in response.choices[0].message.content


def test_streamed_usage_chunk(client):
    chunks = list(chat(client, stream=True, max_tokens=4, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_sequences_split_across_tokens_cut_the_text(client):
    reference = chat(client, max_tokens=16, logprobs=True)
    tokens = [t.token for t in reference.choices[0].logprobs.content]
    text = reference.choices[0].message.content
    # A stop string that spans the boundary between the 4th and 5th tokens.
    boundary = len("".join(tokens[:4]))
    stop = text[boundary - 1 : boundary + 2]
    expected = text[: text.find(stop)]

    for stops in (stop, ["never-seen-zz", stop]):
        response = chat(client, max_tokens=16, stop=stops)
        assert response.choices[0].message.content == expected
        assert response.choices[0].finish_reason == "stop"
        _, streamed, finish = streamed_chat(client, max_tokens=16, stop=stops)
        assert streamed == expected and finish == ["stop"]


def test_chat_logprobs_shape_and_greedy_consistency(client):
    response = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
    chunks = list(chat(client, stream=True, max_tokens=8, logprobs=True, top_logprobs=3))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_completion_logprobs_shape(client):
    response = client.completions.create(model="default", prompt="One, two, three,", max_tokens=6,
                                         temperature=0, logprobs=2)
    lp, text = response.choices[0].logprobs, response.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == text
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert text[offset:].startswith(token)
        assert len(top) <= 2 and max(top.values()) == pytest.approx(logprob)


def test_seed_reproduces_sampled_text(client):
    first = chat(client, temperature=1.0, seed=42, max_tokens=16).choices[0].message.content
    again = chat(client, temperature=1.0, seed=42, max_tokens=16).choices[0].message.content
    other = chat(client, temperature=1.0, seed=43, max_tokens=16).choices[0].message.content
    assert first == again
    assert first != other


def test_concurrent_requests_get_their_own_answers(client):
    # deterministic: equal to the answer alone by contract on any BLAS (on OpenBLAS a plain
    # row's last bits depend on the rows beside it)
    prompts = [GREETING, ARITHMETIC, [{"role": "user", "content": "List two fruits."}]]
    det = {"extra_body": {"deterministic": True}}
    alone = [chat(client, m, max_tokens=10, **det).choices[0].message.content for m in prompts]
    together = [None] * len(prompts)

    def run(i):
        together[i] = chat(client, prompts[i], max_tokens=10, **det).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_disconnected_stream_frees_its_slot(client, http):
    cancelled_before = http.get("/health").json()["cancelled"]
    stream = chat(client, stream=True, max_tokens=2000)
    next(iter(stream))
    stream.close()
    wait_until(lambda: http.get("/health").json()["active"] == 0, timeout=120,
               what="the cancelled request to free its slot")
    assert http.get("/health").json()["cancelled"] == cancelled_before + 1  # freed by cancelling, not by finishing


def test_models_and_health(client, http, embedded_model):
    models = client.models.list().data
    assert [m.id for m in models] == [embedded_model.name, embedded_model.name + ":deterministic"]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["lockstep"]["context_length"] == embedded_model.context_length
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["model"] == embedded_model.name


def test_unknown_model_raises_not_found_in_the_client(client):
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=GREETING, max_tokens=1)


def post(http, path, body):
    if isinstance(body, str):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/v1/chat/completions", {"model": "nope", "messages": GREETING}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", {"model": "default", "messages": GREETING, "temperature": "hot"}, 400, "temperature", None),
        ("/v1/chat/completions", {"model": "default", "messages": GREETING, "temperature": 3}, 400, "temperature", None),
        ("/v1/chat/completions", {"model": "default", "messages": GREETING, "bogus": 1}, 400, "bogus", None),
        ("/v1/chat/completions", {"model": "default", "messages": GREETING, "n": 99}, 400, "n", None),
        ("/v1/chat/completions", {"model": "default", "messages": GREETING, "stop": list("abcde")}, 400, "stop", None),
        ("/v1/chat/completions", {"model": "default", "messages": []}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": GREETING}, 400, "model", None),
        ("/v1/chat/completions", '{"model": "default", "messages": [', 400, None, None),
        ("/v1/completions", {"model": "default", "prompt": "hi", "echo": True}, 400, "echo", None),
        ("/v1/completions", {"model": "default", "prompt": [1] * 9000}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"model": "default", "prompt": [10**9]}, 400, "prompt", None),
    ],
)
def test_errors_have_the_openai_shape(http, path, body, status, param, code):
    response = post(http, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["param"] == param and error["code"] == code
    assert error["type"] == "invalid_request_error" and error["message"]


def test_long_chat_prompt_exceeds_context(http, embedded_model):
    words = "word " * (embedded_model.context_length + 10)
    body = {"model": "default", "messages": [{"role": "user", "content": words}]}
    error = post(http, "/v1/chat/completions", body).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_body_that_is_not_json_is_rejected(http):
    response = http.post("/v1/chat/completions", content="model=default",
                         headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_unknown_route_and_wrong_method(http):
    missing = http.get("/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) == ERROR_KEYS
    wrong = http.get("/v1/chat/completions")
    assert wrong.status_code == 405 and set(wrong.json()["error"]) == ERROR_KEYS


def test_generation_failure_reaches_the_client(embedded_model):
    from fastapi.testclient import TestClient

    from lockstep.server.api.app import create_app
    from tests.doubles.scripted_engine import ScriptedEngine

    def failing(loaded, request, **_):
        yield None
        raise RuntimeError("boom")

    engine = ScriptedEngine(embedded_model, failing).start()
    try:
        with TestClient(create_app(engine)) as test_client:
            body = {"model": "default", "messages": GREETING, "max_tokens": 2}
            response = test_client.post("/v1/chat/completions", json=body)
            assert response.status_code == 500
            assert "boom" in response.json()["error"]["message"]
            streamed = test_client.post("/v1/chat/completions", json={**body, "stream": True})
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert "boom" in json.loads(events[-2])["error"]["message"]
    finally:
        engine.stop()


# ----------------------------------------------------------- issue 31: one model, legacy functions

def test_one_model_by_id_in_openais_shape(http, embedded_model):
    listed = http.get("/v1/models").json()["data"][0]
    for model_id in ("default", embedded_model.name):
        card = http.get(f"/v1/models/{model_id}")
        assert card.status_code == 200 and card.json() == listed  # the card /v1/models lists
    for model_id in ("no-such-model", "org/no-such-model"):  # ids may hold a slash
        missing = http.get(f"/v1/models/{model_id}")
        assert missing.status_code == 404
        assert missing.json()["error"] == {"message": f"The model '{model_id}' does not exist",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}


WEATHER_FUNCTION = {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}


def _events(response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_deprecated_functions_stream_a_function_call(http):
    body = {"model": "default", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
            "functions": [WEATHER_FUNCTION], "function_call": {"name": "get_weather"}, "stream": True,
            "temperature": 0}  # greedy: a sampled draw may name an empty city
    events = _events(http.post("/v1/chat/completions", json=body))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [d["function_call"] for d in deltas if "function_call" in d]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["city"]
    assert not any("tool_calls" in d for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "function_call"


def test_allowed_tools_restricts_the_call_to_the_tools_it_names(http):
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    body = {"model": "default", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
            "tools": [{"type": "function", "function": WEATHER_FUNCTION}, clock], "parallel_tool_calls": False,
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_time"]
