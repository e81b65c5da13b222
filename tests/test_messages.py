"""POST /v1/messages (Anthropic's Messages API) on a live uvicorn, driven by the official
`anthropic` SDK: plain, streamed (the SDK's own event types), a tool round trip, stop sequences,
errors in Anthropic's shape, count_tokens, and the translation to the chat request.

A Messages request runs as the chat request it translates to, so its prompt is checked against
the chat path's prompt for the same conversation, and a streamed answer against the same
request unstreamed (greedy: the same tokens).
"""
import json

import anthropic
import pytest

from lockstep.server.api import messages_protocol as mp
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.auth import _presented_key
from lockstep.server.api.chat_prompt import chat_prompt_tokens
from lockstep.server.api.messages import chat_request
from lockstep.server.api.tool_calls import tool_format

ARITHMETIC = "What is 2+2? Answer with a number only."
POEM = "Write a short poem about the sea."
WEATHER = {"name": "weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(live_server):
    return anthropic.Anthropic(base_url=live_server.removesuffix("/v1"), api_key="x", max_retries=0, timeout=300)


def create(client, content, **kwargs):  # greedy and short unless told
    kwargs.setdefault("max_tokens", 12)
    # this SDK sends no sampling fields (its models choose); older clients do, and lockstep takes them
    kwargs.setdefault("extra_body", {}).setdefault("temperature", 0)
    messages = kwargs.pop("messages", None) or [{"role": "user", "content": content}]
    return client.messages.create(model="default", messages=messages, **kwargs)


def chat_prompt_length(model, messages, **fields) -> int:
    body = ChatCompletionRequest.model_validate({"model": "default", "messages": messages, **fields})
    return len(chat_prompt_tokens(model.tokenizer, body, tool_format(model.tokenizer)))


def test_a_message_answers_with_text_and_the_chat_paths_prompt(client, embedded_model):
    message = create(client, ARITHMETIC, system="You are terse.")
    assert isinstance(message, anthropic.types.Message)
    assert message.role == "assistant" and message.type == "message"
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    expected = chat_prompt_length(embedded_model, [{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": ARITHMETIC}])
    assert message.usage.input_tokens == expected
    assert 0 < message.usage.output_tokens <= 12
    counted = client.messages.count_tokens(model="default", system="You are terse.",
                                           messages=[{"role": "user", "content": ARITHMETIC}])
    assert counted.input_tokens == expected


def test_a_length_cut_answer_says_max_tokens(client):
    message = create(client, POEM, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_a_stream_is_anthropics_event_sequence_and_the_same_answer(client):
    whole = create(client, POEM, max_tokens=10)
    kinds = []
    with client.messages.stream(model="default", max_tokens=10, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": POEM}]) as stream:
        for event in stream:  # the SDK parses each event into its own types (unknown ones fail there)
            kinds.append(event.type)
        final = stream.get_final_message()
    core = [k for k in kinds if k not in ("text", "ping")]  # "text": the SDK's own convenience events
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(core[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_stop_sequence_ends_the_answer_and_is_named(client):
    free = create(client, POEM, max_tokens=16).content[0].text
    word = next(w for w in free.split()[1:] if w.isalpha())  # a word the greedy answer writes later
    message = create(client, POEM, max_tokens=16, stop_sequences=[word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert word not in message.content[0].text and free.startswith(message.content[0].text)


def test_a_forced_tool_call_round_trip(client):
    ask = [{"role": "user", "content": "What's the weather like in Paris?"}]
    called = create(client, None, messages=ask, max_tokens=40, tools=[WEATHER],
                    tool_choice={"type": "tool", "name": "weather"})
    assert called.stop_reason == "tool_use"
    use = [b for b in called.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "weather" and isinstance(use[0].input.get("city"), str)
    assert use[0].id.startswith("toolu_")
    history = ask + [{"role": "assistant", "content": called.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                   "content": "22 degrees and sunny"}]}]
    answer = create(client, None, messages=history, max_tokens=8, tools=[WEATHER])
    assert answer.content[0].type == "text" and answer.content[0].text


def test_a_streamed_tool_call_arrives_as_input_json(client):
    with client.messages.stream(model="default", max_tokens=40, extra_body={"temperature": 0}, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        final = stream.get_final_message()
    use = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(use) == 1 and isinstance(use[0].input["city"], str)


def test_deterministic_is_accepted_and_reported(client):
    message = create(client, ARITHMETIC, extra_body={"deterministic": True, "seed": 3, "temperature": 0.7})
    assert message.model_extra["lockstep"]["deterministic"] is True


@pytest.mark.parametrize("fields, status, kind, words", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"model": "nope"}, 404, "not_found_error", "nope"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error", "image"),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, 400, "invalid_request_error", "tools"),
    ({"top_logprobs": 2}, 400, "invalid_request_error", "top_logprobs"),
])
def test_errors_come_in_anthropics_shape(live_server, fields, status, kind, words):
    import httpx2 as httpx

    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(live_server + "/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert words in error["error"]["message"]


def test_the_sdk_raises_its_own_error_types(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="default", max_tokens=4, messages=[])
    assert raised.value.body["error"]["type"] == "invalid_request_error"


def test_tool_results_and_uses_translate_to_the_chat_shape():
    body = mp.MessagesRequest.model_validate({
        "model": "default", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief.",
                                                         "cache_control": {"type": "ephemeral"}}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "cold"}]},
                                         {"type": "text", "text": "And tomorrow?"}]}]})
    chat = chat_request(body)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant, tool = chat.messages[2], chat.messages[3]
    assert assistant.tool_calls[0].function.name == "weather"
    assert json.loads(assistant.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert tool.tool_call_id == "toolu_1" and tool.content == "cold"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_completion_tokens == 8


def test_the_anthropic_key_header_authenticates():
    assert _presented_key({"headers": [(b"x-api-key", b"k1")]}) == b"k1"
    assert _presented_key({"headers": [(b"authorization", b"Bearer k2"), (b"x-api-key", b"k1")]}) == b"k2"
    assert _presented_key({"headers": []}) is None
