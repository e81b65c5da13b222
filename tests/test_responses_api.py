"""POST /v1/responses on a live uvicorn, driven by the official client's Responses API
(`client.responses.create` and `client.responses.stream`).

A Responses request runs as the chat request it translates to: the translation is checked
directly, and live answers' input_tokens against the chat path's prompt for the same
conversation (a second generation per test would double the file's time on the CPU).
Tool-forcing and `text.format` tests need the grammar engine (server/engine/structured/grammar.py).
"""
import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api import responses_protocol as rp
from lockstep.server.api.chat_prompt import chat_prompt_tokens
from lockstep.server.api.responses import chat_request
from lockstep.server.api.tool_calls import tool_format

ARITHMETIC = "What is 2+2? Answer with a number only."  # the model ends its turn in a few tokens
POEM = "Write a short poem about the sea."
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "weather", "description": "Current weather in a city.",
                "parameters": WEATHER_PARAMETERS, "strict": True}
CHAT_WEATHER_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def client(live_server):
    return OpenAI(base_url=live_server, api_key="x", max_retries=0, timeout=300)


def respond(client, input, **kwargs):  # greedy and short unless told
    kwargs.setdefault("max_output_tokens", 16)
    kwargs.setdefault("temperature", 0)
    return client.responses.create(model="default", input=input, **kwargs)


def chat_prompt_length(model, messages, **fields) -> int:
    """Prompt tokens the chat path builds for `messages` (what a Responses request must match)."""
    body = ChatCompletionRequest.model_validate({"model": "default", "messages": messages, **fields})
    return len(chat_prompt_tokens(model.tokenizer, body, tool_format(model.tokenizer)))


PIRATE_TURNS = [{"role": "user", "content": [{"type": "input_text", "text": "Hello."}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]},
                {"type": "message", "role": "developer", "content": POEM}]
PIRATE_MESSAGES = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello."},
                   {"role": "assistant", "content": "Hi!"}, {"role": "developer", "content": POEM}]
CALL = {"type": "function_call", "call_id": "call_abc", "name": "weather", "arguments": '{"city": "Paris"}'}
RESULT = {"type": "function_call_output", "call_id": "call_abc", "output": "22 degrees and sunny"}
QUESTION = {"role": "user", "content": "What's the weather like in Paris?"}
CALL_MESSAGES = [QUESTION,
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "call_abc", "type": "function",
                      "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "call_abc", "content": "22 degrees and sunny"}]


def test_translation_to_a_chat_request():
    def translated(**fields):
        return chat_request(rp.ResponsesRequest.model_validate({"model": "default", **fields}))

    def expected(**fields):
        return ChatCompletionRequest.model_validate({"model": "default", **fields})

    assert translated(input="Hi").messages == expected(messages=[{"role": "user", "content": "Hi"}]).messages
    assert (translated(input=PIRATE_TURNS, instructions="You are a pirate.").messages
            == expected(messages=PIRATE_MESSAGES).messages)
    tools = translated(input=[QUESTION, CALL, RESULT], tools=[WEATHER_TOOL], tool_choice={"type": "function",
                                                                                          "name": "weather"})
    reference = expected(messages=CALL_MESSAGES, tools=[CHAT_WEATHER_TOOL],
                         tool_choice={"type": "function", "function": {"name": "weather"}})
    assert (tools.messages, tools.tools, tools.tool_choice) == (reference.messages, reference.tools,
                                                                reference.tool_choice)
    schema = translated(input="Hi", max_output_tokens=7, temperature=0.5, seed=3, text={
        "format": {"type": "json_schema", "name": "sum", "schema": {"type": "object"}, "strict": True}})
    assert schema.response_format.json_schema.schema_ == {"type": "object"}
    assert (schema.max_completion_tokens, schema.temperature, schema.seed) == (7, 0.5, 3)


def test_string_input_gives_a_message(client, embedded_model):
    response = respond(client, ARITHMETIC)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == embedded_model.name and response.status == "completed"
    assert response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text.strip()
    assert response.output_text == part.text
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 0 < usage.output_tokens < 16
    assert usage.input_tokens == chat_prompt_length(embedded_model, [{"role": "user", "content": ARITHMETIC}])


def test_messages_and_instructions_become_the_chat_prompt(client, embedded_model):
    response = respond(client, PIRATE_TURNS, instructions="You are a pirate.", max_output_tokens=3)
    assert response.instructions == "You are a pirate." and response.output_text
    assert response.usage.input_tokens == chat_prompt_length(embedded_model, PIRATE_MESSAGES)


def test_stream_accumulates_to_the_non_streamed_answer(client):
    full = respond(client, ARITHMETIC, max_output_tokens=24)
    assert full.status == "completed"
    with client.responses.stream(model="default", input=ARITHMETIC, max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == full.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert final.status == "completed" and final.usage.output_tokens == full.usage.output_tokens
    assert final.id == events[0].response.id and final.output[0].id == events[2].item.id


def test_max_output_tokens_makes_the_response_incomplete(client):
    response = respond(client, POEM, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    # Streamed, it ends as OpenAI's does: in response.incomplete, with the same answer.
    events = list(client.responses.create(model="default", input=POEM, max_output_tokens=3, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.output_text == response.output_text


def test_deterministic_answers_are_identical(client):
    first, second = (respond(client, POEM, max_output_tokens=6, extra_body={"deterministic": True})
                     for _ in range(2))
    assert first.output_text == second.output_text and first.output_text
    assert first.model_extra["lockstep"]["deterministic"] is True


def test_forced_function_call_validates_against_its_parameters(client):
    # Needs the grammar engine: tool_choice naming a function constrains the output. The
    # call alone is 28 tokens in the embedded model's tokenizer (tags spelled out), so 32.
    forced = dict(input="What's the weather like in Paris?", tools=[WEATHER_TOOL],
                  tool_choice={"type": "function", "name": "weather"}, max_output_tokens=32)
    response = respond(client, **forced)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    call = calls[0]
    assert call.name == "weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert response.status == "completed" and not [item for item in response.output if item.type == "message"]
    assert response.tool_choice.name == "weather" and response.tools[0].name == "weather"
    # Streamed: the client's accumulator rebuilds the same call from the arguments events.
    with client.responses.stream(model="default", temperature=0, **forced) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    [streamed] = final.output
    assert (streamed.type, streamed.name, streamed.arguments) == ("function_call", "weather", call.arguments)


def test_function_call_output_round_trip(client, embedded_model):
    # Without `tools` the prompt skips the long tool instructions (the translation test covers
    # tools with calls); the call and its result are still rendered into the prompt.
    response = respond(client, [QUESTION, CALL, RESULT], max_output_tokens=3)
    assert response.status in ("completed", "incomplete") and response.output
    assert response.usage.input_tokens == chat_prompt_length(embedded_model, CALL_MESSAGES)
    assert response.usage.input_tokens > chat_prompt_length(embedded_model, [QUESTION]) + 10


def test_output_items_can_be_sent_back_as_input(client, embedded_model):
    first = respond(client, ARITHMETIC, max_output_tokens=4)
    follow_up = [{"role": "user", "content": ARITHMETIC}, *first.output, {"role": "user", "content": "And 3+3?"}]
    second = respond(client, follow_up, max_output_tokens=2)
    assert second.usage.input_tokens == chat_prompt_length(embedded_model, [
        {"role": "user", "content": ARITHMETIC}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And 3+3?"}])


def test_json_schema_text_format(client):
    # Needs the grammar engine: text.format json_schema constrains the output.
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    response = respond(client, ARITHMETIC, max_output_tokens=24,
                       text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "sum"


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"extra_body": {"n": 2}}, "n"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
])
def test_unsupported_fields_are_400s_naming_the_param(client, extra, param):
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model="default", input="Hi", max_output_tokens=4, **extra)
    assert caught.value.status_code == 400 and caught.value.param == param


def test_store_false_is_accepted(client):
    assert respond(client, ARITHMETIC, store=False, max_output_tokens=1).status == "incomplete"


def test_a_max_output_tokens_above_the_servers_cap_is_named_in_the_message_too(client):
    """Issue 49, finding 12: the 400 named max_output_tokens as its param but its message
    named the chat field it is translated to (max_completion_tokens)."""
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model="default", input="Hi", max_output_tokens=10**9)
    error = caught.value.body
    assert caught.value.param == "max_output_tokens"
    assert error["message"].startswith("max_output_tokens is 1000000000, but this server allows at most ")
    assert "max_completion_tokens" not in error["message"]
