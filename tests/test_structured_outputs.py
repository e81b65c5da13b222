"""Structured outputs and tool calls over HTTP with the official client: constrained decoding
(server/engine/structured/grammar.py) makes even the 135M embedded model answer valid JSON and valid
calls, and deterministic constrained answers stay bit-identical with speculation."""
import json
from types import SimpleNamespace

import jsonschema
import pytest
from openai import BadRequestError

from tests.deterministic_fixtures import float_bits
from tests.http_server import deterministic_server

L = 6
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
    },
    "required": ["city", "population", "capital", "continent"],
    "additionalProperties": False,
}
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON."}]
# Small, so 20 answers stay cheap on 2 cores: an enum, a bounded integer, a boolean.
PLACE = {
    "type": "object",
    "properties": {"continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
                   "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                   "coastal": {"type": "boolean"}},
    "required": ["continent", "rank", "coastal"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(embedded_model):
    with deterministic_server(embedded_model, L) as (client, engine):
        yield SimpleNamespace(client=client, engine=engine)


def chat(server, messages, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    return server.client.chat.completions.create(model="default", messages=messages, **kwargs)


def city_format():
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}


# ------------------------------------------------------------------ structured outputs

def test_json_schema_answers_validate_for_20_seeds(server):
    place = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    answers = []
    for seed in (1, 2):  # n = 10 twice: 20 seed streams (seed, i)
        r = chat(server, ASK_CITY, response_format=place, temperature=1.0, seed=seed, n=10, max_tokens=30)
        answers += [c.message.content for c in r.choices]
        assert all(c.finish_reason == "stop" for c in r.choices)
    invalid = []
    for text in answers:
        try:
            jsonschema.validate(json.loads(text), PLACE)
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append((text, exc))
    assert invalid == [] and len(set(answers)) > 1


def test_json_object_mode_answers_a_json_object(server):
    r = chat(server, ASK_CITY, response_format={"type": "json_object"}, temperature=0, max_tokens=40)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens mid-object: still a JSON object's prefix
        assert r.choices[0].message.content.startswith("{")


def test_an_unsupported_schema_feature_is_a_400_naming_it(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(BadRequestError) as err:
        chat(server, ASK_CITY, response_format=bad)
    assert err.value.body["param"] == "response_format" and "uniqueItems" in err.value.body["message"]


def _bits(choice):
    return [(t.token, float_bits(t.logprob)) for t in choice.logprobs.content]


def test_deterministic_constrained_answers_are_identical_plain_speculative_and_batched(server):
    args = dict(response_format=city_format(), temperature=0.7, seed=5, logprobs=True, max_tokens=50)
    plain = chat(server, ASK_CITY, extra_body={"deterministic": True}, **args).choices[0]
    lookup = chat(server, ASK_CITY, extra_body={"deterministic": True, "speculative": "prompt_lookup",
                                                 "num_draft_tokens": 5}, **args).choices[0]
    assert _bits(lookup) == _bits(plain)
    batched = chat(server, ASK_CITY, n=3, extra_body={"deterministic": True}, **args).choices[0]  # shares passes
    assert _bits(batched) == _bits(plain)
    jsonschema.validate(json.loads(plain.message.content), CITY)


# ------------------------------------------------------------------------- tool calls

def _check_call(call, tools):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.type == "function" and call.id.startswith("call_")


def test_tool_call_round_trip_with_one_call(server):
    tools = [WEATHER, ADD]
    first = chat(server, ASK_WEATHER, tools=tools, tool_choice="required", parallel_tool_calls=False,
                 temperature=0).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert len(first.message.tool_calls) == 1  # parallel_tool_calls off
    call = first.message.tool_calls[0]
    _check_call(call, tools)
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = chat(server, history, tools=tools, tool_choice="none", temperature=0, max_tokens=16).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_required_with_parallel_calls_allowed_gives_valid_calls(server):
    r = chat(server, ASK_WEATHER, tools=[WEATHER, ADD], tool_choice="required", temperature=0, max_tokens=80).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.tool_calls
    for call in r.message.tool_calls:
        _check_call(call, [WEATHER, ADD])


def test_a_named_tool_choice_calls_that_tool_and_streams_the_same_call(server):
    tools = [WEATHER, ADD]
    choice = {"type": "function", "function": {"name": "add"}}
    whole = chat(server, [{"role": "user", "content": "What is 2 plus 3?"}], tools=tools, tool_choice=choice,
                 temperature=0).choices[0]
    assert [c.function.name for c in whole.message.tool_calls] == ["add"]
    _check_call(whole.message.tool_calls[0], tools)
    deltas, finish = [], None
    for chunk in chat(server, [{"role": "user", "content": "What is 2 plus 3?"}], tools=tools, tool_choice=choice,
                      temperature=0, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "add", whole.message.tool_calls[0].function.arguments)]


def test_a_tool_whose_parameters_are_not_an_object_is_a_400_naming_it(server):
    """Issue 25, finding 2: string arguments are no call, so "required" answered none."""
    shout = {"type": "function", "function": {"name": "shout", "parameters": {"type": "string"}}}
    for tool_choice in ("required", "auto"):
        with pytest.raises(BadRequestError) as err:
            chat(server, ASK_WEATHER, tools=[WEATHER, shout], tool_choice=tool_choice, max_tokens=4)
        assert err.value.body["param"] == "tools" and "'shout'" in err.value.body["message"]
        assert 'type "object"' in err.value.body["message"]
