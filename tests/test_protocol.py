"""Request validation (issue 25's adversarial round): bad bodies get a 400 in OpenAI's error
shape, `param` naming the offending field, and a message without the server's internals.

No case reaches the engine, so the live server generates nothing. Bodies given as text are
sent as raw JSON, for the escapes a client library would not produce (lone surrogates).
"""
import httpx2 as httpx
import pytest

from lockstep.server.api import protocol as p
from lockstep.server.api import responses_protocol as rp
from lockstep.server.api.errors import APIError
from lockstep.server.api.responses import chat_request

ERROR_KEYS = {"message", "type", "param", "code"}
# Words that only the server's insides use: its model classes, pydantic's dumps and names
# for union branches, Python reprs of dicts.
INTERNAL = ("ChatCompletionRequest", "ResponsesRequest", "ChatMessage", "NamedToolChoice", "ToolChoiceFunction",
            "StreamOptions", "validation error for", "Value error,", "input_value", "pydantic", "instance of",
            "list[", "tagged-union", "input.str", "Traceback", "{'")

CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
TOOL = {"type": "function", "function": {"name": "weather"}}
FLAT_TOOL = {"type": "function", "name": "weather"}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=60) as client:
        yield client


def post(http, path, body):
    if isinstance(body, str):
        return http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    return http.post(path, json=body)


def error_of(response, param) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert not [word for word in INTERNAL if word in error["message"]], error["message"]
    return error["message"]


# ------------------------------------------- finding 1: logit_bias keys are ASCII token ids

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"²": 1}}),  # isdigit(), not int(): was a 500
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"٣": 1}}),  # Arabic-Indic 3: was taken as token 3
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1" * 5000: 1}}),  # past int()'s digit limit: a 500
    ("/v1/chat/completions", {**CHAT, "logit_bias": {" 3": 1}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"3\n": 1}}),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 1, "logit_bias": {"²": 1}}),
])
def test_logit_bias_keys_must_be_ascii_token_ids(http, path, body):
    assert "token ids" in error_of(post(http, path, body), "logit_bias")


def test_logit_bias_token_ids_parse_as_decimal():
    body = p.ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"0": -100, "007": 5, "49151": 1}})
    assert body.bias_items() == ((0, -100), (7, 5), (49151, 1))


# ------------------------------- finding 2: errors name their field and keep internals inside

SURROGATE_CHAT = '{"model":"default","max_tokens":1,"messages":[{"role":"user","content":"hi"}],%s}'
SURROGATE_RESPONSE = '{"model":"default","max_output_tokens":1,%s}'


@pytest.mark.parametrize("path, body, param, words", [
    # /v1/responses' input: what it may be, not the union's first branch ("input.str")
    ("/v1/responses", {"model": "default", "input": []}, "input", "non-empty list of input items"),
    ("/v1/responses", {"model": "default", "input": {}}, "input", "a string or a non-empty list"),
    ("/v1/responses", {"model": "default", "input": [5]}, "input", "input items must be objects"),
    ("/v1/responses", {"model": "default", "input": [{"role": "user", "content": 5}]}, "input",
     "'input.0.content': Input should be a string or a list"),
    # lone surrogates, anywhere: a 400 naming the field (some were pydantic dumps, some 500s)
    ("/v1/responses", SURROGATE_RESPONSE % '"input":"\\ud800"', "input", "lone surrogate"),
    ("/v1/responses", SURROGATE_RESPONSE % '"input":"hi","instructions":"\\ud800"', "instructions",
     "lone surrogate"),
    ("/v1/responses", SURROGATE_RESPONSE % '"input":[{"role":"user","content":"\\ud800"}]', "input",
     "lone surrogate in input.0.content"),
    ("/v1/responses", SURROGATE_RESPONSE % '"input":"hi","metadata":{"k":"\\udfff"}', "metadata", "lone surrogate"),
    ("/v1/chat/completions", SURROGATE_CHAT % '"model":"\\ud800"', "model", "lone surrogate"),
    ("/v1/chat/completions", SURROGATE_CHAT % '"stop":"\\ud800"', "stop", "lone surrogate"),
    ("/v1/chat/completions", SURROGATE_CHAT % '"logit_bias":{"\\ud800":1}', "logit_bias", "lone surrogate"),
    ("/v1/chat/completions", SURROGATE_CHAT % '"user":"\\ud800"', "user", "lone surrogate"),
    ("/v1/chat/completions", SURROGATE_CHAT % '"\\ud800":1', None, "lone surrogate"),
    ("/v1/chat/completions", '{"model":"default","messages":[{"role":"assistant","tool_calls":[{"id":"c",'
     '"type":"function","function":{"name":"f","arguments":"\\ud800"}}]}]}', "messages",
     "lone surrogate in messages.0.tool_calls.0.function.arguments"),
    ("/v1/completions", '{"model":"default","prompt":"hi","stop":["\\udc00"]}', "stop", "lone surrogate"),
    # tool_choice checked against tools: a model validator named no field (param null)
    ("/v1/responses", {"model": "default", "input": "hi", "tools": [FLAT_TOOL],
                       "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", "not in tools"),
    ("/v1/responses", {"model": "default", "input": "hi", "tool_choice": "required"}, "tool_choice",
     "needs tools"),
    ("/v1/responses", {"model": "default", "input": "hi", "tools": [FLAT_TOOL, FLAT_TOOL]}, "tools", "unique"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "other"}}}, "tool_choice", "not in tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, "tools", "unique"),
    # what the translation to a chat request refused, as pydantic's dump of ChatCompletionRequest
    ("/v1/responses", {"model": "default", "input": [{"type": "function_call_output", "call_id": "",
                                                      "output": "x"}]}, "input", "call_id"),
    # pydantic's messages that name a class, or a union branch
    ("/v1/chat/completions", {**CHAT, "messages": [5]}, "messages", "Input should be an object"),
    ("/v1/chat/completions", {**CHAT, "stream_options": 5}, "stream_options", "Input should be an object"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": 5}, "tool_choice", "or an object"),
    ("/v1/responses", {"model": "default", "input": "hi", "tool_choice": 5}, "tool_choice", "or an object"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages", "'messages.0.content.0.text': Input should be a string"),
    ("/v1/completions", {"model": "default", "prompt": {}}, "prompt", "Input should be a string or a list"),
])
def test_bad_bodies_are_400s_naming_the_field(http, path, body, param, words):
    assert words in error_of(post(http, path, body), param)


def test_strict_types_and_unknown_fields_are_unchanged(http):
    assert "'max_tokens'" in error_of(post(http, "/v1/chat/completions", {**CHAT, "max_tokens": "4"}), "max_tokens")
    assert error_of(post(http, "/v1/chat/completions", {**CHAT, "frobnicate": 1}), "frobnicate") == (
        "Unrecognized request argument supplied: frobnicate")


def test_a_translation_error_names_the_responses_field():
    # ResponsesRequest refuses these first; built unvalidated, they reach the chat model, and
    # its refusal must still name the Responses field without the chat model's insides.
    for fields, param in [({"input": [rp.FunctionCallOutputInput.model_construct(
                              type="function_call_output", call_id="", output="x")]}, "input"),
                          ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                          ({"input": "hi", "tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(APIError) as caught:
            chat_request(rp.ResponsesRequest.model_construct(model="default", **fields))
        error = caught.value.body
        assert caught.value.status == 400 and error.param == param, error
        assert not [word for word in INTERNAL if word in error.message], error.message
