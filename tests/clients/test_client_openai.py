"""The official `openai` client: chat, streaming, a tool call round trip, `parse()`, the
Responses API, `models.retrieve`, replaying history with `message.model_dump()`, the request
fields the current spec has, the deprecated functions and Predicted Outputs."""
import json
from typing import Literal

import pytest
from openai import BadRequestError, NotFoundError, OpenAI, pydantic_function_tool
from pydantic import BaseModel, Field

HI = [{"role": "user", "content": "Say hi."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# A closed schema: the constrained call ends as soon as the city is written.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": CITY, "strict": True}}]
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def client(base_url, api_key):
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)


def chat(client, messages=HI, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="default", messages=messages, **kwargs)


def test_chat_answers_in_openais_shape(client):
    response = chat(client)
    message = response.choices[0].message
    assert response.object == "chat.completion" and message.role == "assistant" and message.content
    assert message.refusal is None and message.tool_calls is None
    details = response.usage.completion_tokens_details
    assert response.usage.completion_tokens == 8 and details.reasoning_tokens == 0
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_a_stream_is_the_same_answer_with_its_usage_last(client):
    whole = chat(client).choices[0].message.content
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_history_replayed_with_model_dump_is_accepted(client):
    first = chat(client)
    dumped = first.choices[0].message.model_dump()
    # what the client sends back: every field of its message type, nulls included
    assert {"refusal", "audio", "function_call", "tool_calls", "annotations"} <= set(dumped)
    history = HI + [dumped, {"role": "user", "content": "Again."}]
    assert chat(client, history).choices[0].message.content
    chunks = list(chat(client, history, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def test_a_tool_call_round_trip(client):
    called = chat(client, WEATHER, tools=TOOLS, tool_choice=CALL_WEATHER, max_tokens=40)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert set(json.loads(call.function.arguments)) == {"city"}
    history = WEATHER + [choice.message.model_dump(),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    answer = chat(client, history, tools=TOOLS)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_calls_carry_index_id_and_name(client):
    chunks = list(chat(client, WEATHER, tools=TOOLS, tool_choice=CALL_WEATHER, max_tokens=40, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parse_returns_the_schemas_object(client):
    parsed = client.chat.completions.parse(model="default", messages=[{"role": "user", "content": "Is water wet?"}],
                                           response_format=Verdict, max_tokens=16, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)


class Weather(BaseModel):
    city: str = Field(max_length=12)


def test_parsed_answers_sent_back_as_the_client_returns_them_are_accepted(client):
    """Issue 49, finding 13: a `parse()` answer appended to the history as it is (the message
    object, or its model_dump) carries `parsed` and each call's `parsed_arguments`, and the
    tool result its function's `name` (instructor's re-ask, litellm's tool results): OpenAI
    accepts and ignores them; lockstep answered 400 to every retry."""
    weather = pydantic_function_tool(Weather, name="get_weather")
    called = client.chat.completions.parse(model="default", messages=WEATHER, tools=[weather],
                                           tool_choice=CALL_WEATHER, max_tokens=40, temperature=0)
    message = called.choices[0].message
    call = message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)
    dumped = message.model_dump()
    assert "parsed" in dumped and "parsed_arguments" in dumped["tool_calls"][0]["function"]
    result = {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "18 C and sunny"}
    for sent in (message, dumped):
        answer = chat(client, WEATHER + [sent, result], tools=TOOLS)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")

    question = [{"role": "user", "content": "Is water wet?"}]
    verdict = client.chat.completions.parse(model="default", messages=question, response_format=Verdict,
                                            max_tokens=16, temperature=0).choices[0].message
    assert isinstance(verdict.parsed, Verdict) and verdict.model_dump()["parsed"] == verdict.parsed.model_dump()
    for sent in (verdict, verdict.model_dump()):
        assert chat(client, question + [sent, {"role": "user", "content": "Sure?"}]).choices[0].message.content


def test_the_responses_api(client):
    response = client.responses.create(model="default", input="Say hi.", max_output_tokens=8)
    assert response.object == "response" and response.output_text
    assert 0 < response.usage.output_tokens <= 8


def test_models_retrieve_by_alias_and_by_name(client):
    listed = client.models.list().data
    assert len(listed) == 2 and listed[1].id == listed[0].id + ":deterministic"
    by_alias = client.models.retrieve("default")
    assert (by_alias.id, by_alias.object, by_alias.owned_by) == (listed[0].id, "model", "lockstep")
    assert client.models.retrieve(listed[0].id).id == listed[0].id
    with pytest.raises(NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    error = missing.value.body
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "no-such-model" in error["message"]


def test_every_standard_field_is_accepted(client):
    response = chat(client, max_tokens=4, max_completion_tokens=4, n=1, top_p=1, presence_penalty=0,
                    frequency_penalty=0, logit_bias={}, logprobs=False, stop=None, seed=1, user="u",
                    store=True, metadata={"run": "ci"}, service_tier="auto", reasoning_effort="low",
                    verbosity="low", prompt_cache_key="k", prompt_cache_retention="24h",
                    safety_identifier="s", modalities=["text"], audio=None, prediction=None,
                    web_search_options=None, parallel_tool_calls=True, response_format={"type": "text"},
                    stream_options=None, top_logprobs=None)
    assert response.choices[0].message.content and response.service_tier == "default"


def test_audio_output_is_refused_naming_the_field(client):
    with pytest.raises(BadRequestError) as refused:
        chat(client, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    assert refused.value.body["param"] == "modalities" and "audio" in refused.value.body["message"]


def test_deprecated_functions_answer_with_a_function_call(client):
    functions = [{"name": "get_weather", "description": "Current weather in a city", "parameters": CITY}]
    response = chat(client, WEATHER, functions=functions, function_call={"name": "get_weather"}, max_tokens=40)
    choice = response.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "get_weather"
    history = WEATHER + [choice.message.model_dump(),
                         {"role": "function", "name": "get_weather", "content": "18 C and sunny"}]
    assert chat(client, history, functions=functions).choices[0].finish_reason in ("stop", "length", "function_call")


def test_a_prediction_is_counted_in_the_usage(client):
    answer = chat(client, max_tokens=8).choices[0].message.content
    response = chat(client, max_tokens=8, prediction={"type": "content", "content": answer})
    details = response.usage.completion_tokens_details
    ext = response.model_extra["lockstep"]
    assert ext["speculative"] == "prediction"
    assert details.accepted_prediction_tokens == ext["accepted_tokens"] > 0
    assert details.rejected_prediction_tokens == ext["drafted_tokens"] - ext["accepted_tokens"]
