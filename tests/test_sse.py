"""server/api/sse.py: a stream's events gathered into one write while more are queued; over
HTTP, a stream whose deltas are all queued before it is read goes out in few writes, with the
same bytes a stream written event by event has."""
import asyncio

import httpx2 as httpx
import pytest
from openai import OpenAI

from lockstep.server.api import sse

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def test_events_are_held_while_the_next_is_queued():
    queue = [True, True, False, False]
    writes = sse.Writes(lambda: queue.pop(0))
    assert [writes.add(e) for e in ("a", "b", "c", "d")] == [None, None, "abc", "d"]
    assert writes.take() == ""
    plain = sse.Writes()
    assert [plain.add(e) for e in ("a", "b")] == ["a", "b"]


def test_a_handle_says_when_it_holds_unread_events():
    from lockstep.server.engine.scheduling.handle import RequestHandle
    from lockstep.server.engine.decoding.request_state import Delta, GenerationRequest

    async def run():
        handle = RequestHandle(GenerationRequest(prompt_tokens=[1], max_tokens=1), asyncio.get_running_loop())
        assert not sse.queued(handle)
        handle._put([Delta(text="x", prompt_tokens=1, completion_tokens=1, finish_reason="length")])
        assert sse.queued(handle)
        assert [d.text async for d in handle] == ["x"]
        assert not sse.queued(handle)
    asyncio.run(run())
    assert not sse.queued(object())  # a handle that cannot tell: every event its own write


class BodyWrites:
    """ASGI wrapper: counts a response's body writes; the first one waits until the engine has
    no active request (every delta of the stream is then queued), a bounded wait."""

    def __init__(self, app, engine):
        self.app, self.engine, self.writes, self.body = app, engine, 0, b""

    async def __call__(self, scope, receive, send):
        async def counted(message):
            if message["type"] == "http.response.body" and message.get("body"):
                if self.writes == 0:
                    for _ in range(3000):
                        if self.engine.counts()["active"] == 0:
                            break
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0)  # the last pass's deltas reach the handle's queue
                self.writes += 1
                self.body += message["body"]
            await send(message)
        await self.app(scope, receive, counted)


@pytest.fixture(scope="module")
def engine(embedded_model):
    from lockstep.server.engine import Engine

    engine = Engine(embedded_model, max_active=2).start()
    yield engine
    engine.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "The capital of France is"}),
])
def test_a_stream_queued_ahead_of_its_reader_goes_out_in_few_writes(engine, path, body):
    from lockstep.server.api.app import create_app
    from tests.http_server import running

    app = BodyWrites(create_app(engine), engine)
    body = {"model": "default", "max_tokens": 16, "temperature": 0, **body}
    with running(app) as url:
        with httpx.Client(base_url=url, timeout=300) as http:
            raw = http.post(path, json={**body, "stream": True}).text
        first_writes, first_body = app.writes, app.body.decode()
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        if "messages" in body:
            full = client.chat.completions.create(**body).choices[0].message.content
            streamed = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(**body, stream=True) if c.choices)
        else:
            full = client.completions.create(**body).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
    events = [e for e in raw.split("\n\n") if e]
    assert len(events) >= 16 and events[-1] == "data: [DONE]"
    assert streamed == full and first_body == raw
    # the first event alone, then everything queued behind it, then [DONE]
    assert first_writes <= 3 < len(events)
