"""server/api/chunk_json.py: a chunk's JSON from its template is pydantic's, byte for byte; and
every event a live stream sends is its own chunk as pydantic renders it (plain, n > 1,
logprobs, tools; chat and completions)."""
import json

import httpx2 as httpx
import pytest

from lockstep.server.api.response_bodies import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice,
                                                 TextCompletion)
from lockstep.server.api import chat, completions
from lockstep.server.api.chunk_json import ChunkTemplate

TEXTS = ["", "a", " the", 'quo"te \\ back', "é ü 中文 🦊", "\x00\x01\x1f\x7f", "line\nbreak\ttab\r",
         "\u2028\u2029", "</script>", "\ud7ff\ue000", "{\"json\": [1, 2]}"]


def chat_chunk(created, text, index=0, **common):
    return ChatCompletionChunk(id="chatcmpl-1", model="m", system_fingerprint="fp_1", created=created, **common,
                               choices=[ChatChunkChoice(index=index, delta=ChatDelta(content=text))])


def completion_chunk(created, text, index=0):
    return TextCompletion(id="cmpl-1", model="m", system_fingerprint=None, created=created,
                          choices=[CompletionChoice(index=index, text=text)])


@pytest.mark.parametrize("build", [chat_chunk, completion_chunk,
                                   lambda c, t: chat_chunk(c, t, index=3, service_tier="default")])
def test_a_template_renders_what_pydantic_renders(build, monkeypatch):
    import lockstep.server.api.chunk_json as chunk_json

    monkeypatch.setattr(chunk_json.time, "time", lambda: 1_700_000_000.9)  # one second for both
    template = ChunkTemplate(build)
    for text in TEXTS:
        assert template.render(text) == build(1_700_000_000, text).model_dump_json()


def test_a_chunk_without_the_markers_is_refused():
    with pytest.raises(ValueError, match="created"):
        ChunkTemplate(lambda created, text: chat_chunk(1, text))
    with pytest.raises(ValueError, match="text"):
        ChunkTemplate(lambda created, text: chat_chunk(created, "fixed"))


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.mark.parametrize("path,body,model", [
    ("/v1/chat/completions", {"messages": MESSAGES}, ChatCompletionChunk),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 3}, ChatCompletionChunk),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}, ChatCompletionChunk),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                              "tool_choice": "required", "max_tokens": 40}, ChatCompletionChunk),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, ChatCompletionChunk),
    ("/v1/completions", {"prompt": "The capital of France is"}, TextCompletion),
    ("/v1/completions", {"prompt": "The sea", "n": 2, "temperature": 1.0, "seed": 3}, TextCompletion),
    ("/v1/completions", {"prompt": "The sea", "logprobs": 2}, TextCompletion),
])
def test_every_streamed_event_is_pydantics_rendering_of_itself(live_server, path, body, model):
    body = {"model": "default", "max_tokens": 12, "temperature": 0, "stream": True, **body}
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as http:
        response = http.post(path, json=body)
    assert response.status_code == 200
    lines = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and len(lines) > 3
    for line in lines[:-1]:
        assert model.model_validate_json(line).model_dump_json() == line
    choices = [c for line in lines[:-1] for c in json.loads(line)["choices"]]
    assert any(c.get("text") or c.get("delta", {}).get("content") or c.get("delta", {}).get("tool_calls")
               for c in choices)


@pytest.mark.parametrize("path,body,module,name", [
    ("/v1/chat/completions", {"messages": MESSAGES}, chat, "ChatCompletionChunk"),
    ("/v1/completions", {"prompt": "The capital of France is"}, completions, "TextCompletion"),
])
def test_a_text_stream_builds_its_chunk_objects_once_not_per_token(live_server, monkeypatch, path, body, module,
                                                                   name):
    built = []
    model = getattr(module, name)  # patched where the endpoint builds them

    def counted(*args, **kwargs):
        built.append(kwargs.get("choices"))
        return model(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    body = {"model": "default", "max_tokens": 16, "temperature": 0, "stream": True, **body}
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as http:
        events = [e for e in http.post(path, json=body).text.split("\n\n") if e.startswith("data: {")]
    assert len(events) >= 16
    # the template's one rendering, the role's first chunk (chat) and the final chunk
    assert len(built) <= 3


# ------------------------------------------------- /v1/responses and /v1/messages text deltas

def test_a_responses_delta_renders_what_pydantic_renders():
    from lockstep.server.api import responses_protocol as rp
    from lockstep.server.api.responses import delta_template

    template = delta_template("msg_1", 2)
    for sequence, text in enumerate(TEXTS):
        event = rp.TextDeltaEvent(item_id="msg_1", output_index=2, content_index=0, delta=text,
                                  sequence_number=sequence + 1000)
        assert template.fill(text, sequence + 1000) == event.model_dump_json()


def test_a_messages_delta_is_the_event_its_framing_writes():
    from lockstep.server.api import messages_protocol as mp
    from lockstep.server.api.messages import delta_template

    template = delta_template(1)
    for text in TEXTS:
        assert template.fill(text) == mp.event("content_block_delta", index=1,
                                               delta={"type": "text_delta", "text": text})


def _sse_events(text: str) -> list[tuple[str, str]]:
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if "event" in lines:
            events.append((lines["event"], lines["data"]))
    return events


def test_a_responses_stream_builds_no_delta_object_per_token(live_server, monkeypatch):
    """Each text delta is its message's template filled in (one TextDeltaEvent built, for the
    template), and every event is pydantic's rendering of itself."""
    from lockstep.server.api import responses_protocol as rp

    built = []
    original = rp.TextDeltaEvent

    def counted(*args, **kwargs):
        built.append(kwargs.get("delta"))
        return original(*args, **kwargs)
    monkeypatch.setattr(rp, "TextDeltaEvent", counted)
    body = {"model": "default", "input": "Write a short poem about the sea.", "max_output_tokens": 16,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as http:
        response = http.post("/v1/responses", json=body)
    assert response.status_code == 200
    events = _sse_events(response.text)
    deltas = [data for kind, data in events if kind == "response.output_text.delta"]
    assert len(deltas) >= 8 and len(built) <= 1
    assert [json.loads(data)["sequence_number"] for _, data in events] == list(range(len(events)))
    for data in deltas:
        assert original.model_validate_json(data).model_dump_json() == data


def test_a_messages_stream_builds_no_delta_dict_per_token(live_server, monkeypatch):
    """Each text delta is its block's template filled in (`mp.event` called once for it), and
    every event's data is what json.dumps writes for it."""
    from lockstep.server.api import messages_protocol as mp

    kinds = []
    original = mp.event
    monkeypatch.setattr(mp, "event", lambda kind, **fields: kinds.append(kind) or original(kind, **fields))
    body = {"model": "default", "max_tokens": 16, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as http:
        response = http.post("/v1/messages", json=body)
    assert response.status_code == 200
    events = _sse_events(response.text)
    deltas = [data for kind, data in events if kind == "content_block_delta"]
    assert len(deltas) >= 8 and kinds.count("content_block_delta") <= 1
    for data in deltas:
        assert json.dumps(json.loads(data), ensure_ascii=False) == data
