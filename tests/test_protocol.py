"""Request validation (issue 25's adversarial round): bad bodies get a 400 in OpenAI's error
shape, `param` naming the offending field, and a message without the server's internals.

No case reaches the engine, so the live server generates nothing. Bodies given as text are
sent as raw JSON, for the escapes a client library would not produce (lone surrogates).
"""
import httpx2 as httpx
import pytest

from lockstep.server.api.chat_protocol import (AssistantMessageParam, ChatCompletionRequest, DeveloperMessage,
                                               FunctionMessage, Prediction, PromptCacheOptions, SystemMessage,
                                               TextContentPart, ToolMessage, UserMessage, WebSearchOptions)

from lockstep.server.api.completions_protocol import CompletionRequest

from lockstep.server.api.sampling_protocol import StreamOptions

from lockstep.server.api.tools_protocol import ToolCall
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
    body = ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"0": -100, "007": 5, "49151": 1}})
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


# --------------------------------- issue 31: the whole current request schema, from the spec

def _spec_keys(typed_dict) -> set[str]:
    return set(typed_dict.__annotations__)


def _fields(model) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def test_every_field_of_the_clients_request_types_is_known():
    """The official client's request types (generated from OpenAI's spec): each field is in
    lockstep's schema, so none is "Unrecognized" (whether implemented, ignored or refused is
    docs/API.md's table)."""
    from openai.types import completion_create_params as completion
    from openai.types.chat import (chat_completion_assistant_message_param as assistant,
                                   chat_completion_content_part_text_param as text_part,
                                   chat_completion_developer_message_param as developer,
                                   chat_completion_function_message_param as function,
                                   chat_completion_message_function_tool_call_param as tool_call,
                                   chat_completion_prediction_content_param as prediction,
                                   chat_completion_stream_options_param as stream_options,
                                   chat_completion_system_message_param as system,
                                   chat_completion_tool_message_param as tool,
                                   chat_completion_user_message_param as user)
    from openai.types.chat import completion_create_params as chat

    pairs = [
        (chat.CompletionCreateParamsStreaming, ChatCompletionRequest),
        (completion.CompletionCreateParamsStreaming, CompletionRequest),
        (system.ChatCompletionSystemMessageParam, SystemMessage),
        (developer.ChatCompletionDeveloperMessageParam, DeveloperMessage),
        (user.ChatCompletionUserMessageParam, UserMessage),
        (assistant.ChatCompletionAssistantMessageParam, AssistantMessageParam),
        (tool.ChatCompletionToolMessageParam, ToolMessage),
        (function.ChatCompletionFunctionMessageParam, FunctionMessage),
        (tool_call.ChatCompletionMessageFunctionToolCallParam, ToolCall),
        (text_part.ChatCompletionContentPartTextParam, TextContentPart),
        (prediction.ChatCompletionPredictionContentParam, Prediction),
        (stream_options.ChatCompletionStreamOptionsParam, StreamOptions),
        (chat.WebSearchOptions, WebSearchOptions),
        (chat.PromptCacheOptions, PromptCacheOptions),
    ]
    for spec, model in pairs:
        assert _spec_keys(spec) <= _fields(model), (spec.__name__, _spec_keys(spec) - _fields(model))


REPLAYED = {"content": "Hello", "refusal": None, "role": "assistant", "annotations": None, "audio": None,
            "function_call": None, "tool_calls": None}


def test_history_as_the_client_dumps_it_is_accepted():
    call = {"id": "call_1", "function": {"arguments": "{}", "name": "weather"}, "type": "function", "index": 0}
    body = ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL], "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief.",
                                           "prompt_cache_breakpoint": {"mode": "explicit"}}], "name": "ops"},
        {"role": "user", "content": "hi", "name": "ann"}, REPLAYED,
        {**REPLAYED, "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": None, "refusal": "I can't help with that."},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]}]})
    assert [m.text() for m in body.messages] == ["Be brief.", "hi", "Hello", "", "sunny", "I can't help with that.",
                                                 "ab"]
    assert body.messages[3].tool_calls[0].function.name == "weather" and body.messages[4].tool_call_id == "call_1"


def test_a_parsed_answer_and_a_named_tool_result_are_accepted_and_ignored():
    """Issue 49, finding 13: the openai SDK's `parse()` message as its model_dump gives it
    (`parsed`, each call's `parsed_arguments`, and `refusal`, `audio`, `annotations`,
    `function_call` as null) and a tool result with its function's `name` were 400s."""
    from openai.types.chat import ParsedChatCompletionMessage, ParsedFunction, ParsedFunctionToolCall
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    arguments = '{"city": "Paris"}'
    parsed = ParsedChatCompletionMessage[City](
        role="assistant", content=arguments, parsed=City(city="Paris"), tool_calls=[ParsedFunctionToolCall(
            id="call_1", type="function", function=ParsedFunction(name="weather", arguments=arguments,
                                                                  parsed_arguments=City(city="Paris")))])
    dumped = parsed.model_dump()
    assert {"parsed", "refusal", "audio", "annotations", "function_call"} <= set(dumped)
    assert "parsed_arguments" in dumped["tool_calls"][0]["function"]
    body = ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL], "messages": [
        {"role": "user", "content": "weather?"}, dumped,
        {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": "sunny"}]})
    assert [m.text() for m in body.messages] == ["weather?", arguments, "sunny"]
    assert body.messages[1].tool_calls[0].function.arguments == arguments
    # only what the SDK sends back is accepted: other unknown fields still name themselves
    for message, field in [({**dumped, "parsed_output": None}, "parsed_output"),
                           ({"role": "tool", "tool_call_id": "call_1", "content": "x", "title": "t"}, "title")]:
        with pytest.raises(ValueError, match=field):
            ChatCompletionRequest.model_validate({**CHAT, "messages": [message]})


def test_nulls_are_the_defaults():
    body = ChatCompletionRequest.model_validate({**CHAT, **dict.fromkeys(
        ["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "audio",
         "modalities", "prediction", "web_search_options", "metadata", "store", "service_tier"])})
    assert (body.temperature, body.top_p, body.n, body.stream, body.logprobs) == (1.0, 1.0, 1, False, False)
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": None, "logprobs": None,
                                             "best_of": 1}).echo is False


def test_deprecated_functions_become_tools_and_function_messages_tool_results():
    body = ChatCompletionRequest.model_validate({**CHAT, "functions": [{"name": "weather"}, {"name": "time"}],
                                                 "function_call": {"name": "time"}, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "time", "arguments": "{}"}},
        {"role": "function", "name": "time", "content": "noon"}]})
    assert [t.function.name for t in body.tools] == ["weather", "time"] and body.tool_mode() == "named"
    assert body.legacy_functions() and not body.parallel_tool_calls  # one call per legacy answer
    call, result = body.messages[1], body.messages[2]
    assert call.tool_calls[0].function.name == "time" and result.role == "tool"
    assert result.tool_call_id == call.tool_calls[0].id and result.text() == "noon"
    assert ChatCompletionRequest.model_validate({**CHAT, "functions": [{"name": "f"}]}).tool_mode() == "auto"


def test_allowed_tools_offers_only_the_tools_it_names():
    body = ChatCompletionRequest.model_validate({**CHAT, "tools": [TOOL, {"type": "function", "function": {
        "name": "clock"}}], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "clock"}}]}}})
    assert [t.function.name for t in body.tools] == ["clock"] and body.tool_mode() == "required"


def test_the_prediction_text_joins_its_parts():
    body = ChatCompletionRequest.model_validate({**CHAT, "prediction": {"type": "content", "content": [
        {"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}})
    assert body.prediction_text() == "a b" and ChatCompletionRequest.model_validate(CHAT).prediction_text() is None


FUNCTION_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("path, body, param, words", [
    # what lockstep cannot do: a 400 naming the field and why
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities", "writes text only"),
    ("/v1/chat/completions", {**CHAT, "audio": {"format": "wav", "voice": "alloy"}}, "audio", "no audio output"),
    ("/v1/chat/completions", {**CHAT, "web_search_options": {}}, "web_search_options", "no web search"),
    ("/v1/chat/completions", {**CHAT, "moderation": {"model": "omni-moderation-latest"}}, "moderation",
     "no moderation"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools",
     "function tools only"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "custom", "custom": {"name": "c"}}},
     "tool_choice", "function tools only"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_obfuscation": True}}, "stream_options",
     "does not pad"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]},
     "messages", "no earlier audio"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "n", "input": "i"}}]}]}, "messages", "function tools only"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "best_of": 3}, "best_of", "equal to n"),
    # conflicting or dangling legacy fields
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "functions": [{"name": "f"}]}, "tools", "not both"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call", "needs functions"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}], "function_call": {"name": "g"}},
     "function_call", "not in functions"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}], "tool_choice": "auto"}, "tool_choice",
     "function_call"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "other"}}]}}}, "tool_choice",
     "not in tools"),
    # a field another role has is still unknown on this one; a message needs a known role
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "refusal": None}]}, "messages",
     "Unrecognized request argument supplied: messages.0.refusal"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": "x", "tool_calls": [
        FUNCTION_CALL]}]}, "messages", "only assistant messages carry tool_calls"),
    ("/v1/chat/completions", {**CHAT, "messages": [{**REPLAYED, "tool_call_id": "c"}]}, "messages",
     "Unrecognized request argument supplied: messages.0.tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages",
     "needs a role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "content": "x"}]}, "messages",
     "'messages.0.name': Field required"),
    # strict types and the spec's own limits still hold for the new fields
    ("/v1/chat/completions", {**CHAT, "store": "yes"}, "store", "a boolean"),
    ("/v1/chat/completions", {**CHAT, "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"k": 5}}, "metadata", "a string"),
    ("/v1/chat/completions", {**CHAT, "service_tier": "gold"}, "service_tier", "'priority'"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort", "'minimal'"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": 5}}, "prediction",
     "a string or a list"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "text", "content": "x"}}, "prediction", "'content'"),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"},
                              "speculative": "prompt_lookup"}, "speculative", "drafts from the prediction"),
])
def test_refused_fields_are_400s_naming_the_field_and_why(http, path, body, param, words):
    assert words in error_of(post(http, path, body), param)
