"""server/api/chunk_json.py: a chunk's JSON from its template is pydantic's, byte for byte; and
every event a live stream sends is its own chunk as pydantic renders it (plain, n > 1,
logprobs, tools; chat and completions)."""
import json

import httpx2 as httpx
import pytest

from lockstep.server.api.response_bodies import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice,
                                                 TextCompletion)
from lockstep.server.api import app as app_module
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


@pytest.mark.parametrize("path,body,name", [
    ("/v1/chat/completions", {"messages": MESSAGES}, "ChatCompletionChunk"),
    ("/v1/completions", {"prompt": "The capital of France is"}, "TextCompletion"),
])
def test_a_text_stream_builds_its_chunk_objects_once_not_per_token(live_server, monkeypatch, path, body, name):
    built = []
    model = getattr(app_module, name)  # patched where the routes build them

    def counted(*args, **kwargs):
        built.append(kwargs.get("choices"))
        return model(*args, **kwargs)
    monkeypatch.setattr(app_module, name, counted)
    body = {"model": "default", "max_tokens": 16, "temperature": 0, "stream": True, **body}
    with httpx.Client(base_url=live_server.removesuffix("/v1"), timeout=300) as http:
        events = [e for e in http.post(path, json=body).text.split("\n\n") if e.startswith("data: {")]
    assert len(events) >= 16
    # the template's one rendering, the role's first chunk (chat) and the final chunk
    assert len(built) <= 3
