"""Grammar checks on threads of their own (server/api/grammar_checks.py), issue 49 finding 2:
a burst of grammar requests must not hold the threads that prepare plain requests, and
checks beyond the bounded queue are a 429 with Retry-After in OpenAI's error shape.

The checker here is a double that blocks on an event, so "waiting behind" is shown by
counting who got through while it blocks, not by clocks.
"""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from lockstep.server.api.errors import APIError, RETRY_AFTER_S
from lockstep.server.api.grammar_checks import GrammarChecks
from lockstep.server.engine.generate import Delta
from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import running, wait_until

PLAIN = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINED = {**PLAIN, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
HANG_GUARD_S = 60


def one_token(loaded, request, **_):
    yield Delta(text="ok", prompt_tokens=len(request.prompt_tokens), completion_tokens=1, finish_reason="stop")


class BlockingChecker:
    """Stands in for the grammar compiler: each check counts itself, then blocks until released."""

    def __init__(self):
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0

    def json_schema(self, schema):
        with self._lock:
            self.entered += 1
        assert self.release.wait(HANG_GUARD_S)
        return None  # no grammar: the scripted engine answers as for a plain request


@pytest.fixture
def checker(monkeypatch):
    checker = BlockingChecker()
    monkeypatch.setattr("lockstep.server.engine.structured.grammar.compiler_for", lambda loaded: checker)
    yield checker
    checker.release.set()


@pytest.fixture
def app_url(embedded_model, checker):
    """One grammar check thread and no queue: a second grammar request at once is a 429."""
    from lockstep.server.api.app import create_app
    from lockstep.server.api.limits import Limits

    engine = ScriptedEngine(embedded_model, one_token).start()
    try:
        with running(create_app(engine, limits=Limits(grammar_workers=1, grammar_queue=0))) as url:
            yield url
    finally:
        checker.release.set()
        engine.stop()


def default_pool_size() -> int:
    """Threads in the event loop's default executor (asyncio.to_thread's), as Python sizes it."""
    pool = ThreadPoolExecutor()
    try:
        return pool._max_workers
    finally:
        pool.shutdown()


def test_a_plain_request_is_answered_while_grammar_checks_hold_as_many_threads_as_the_default_pool(app_url, checker):
    crowd = default_pool_size()  # enough to hold every default-pool thread, were checks run there
    client = openai.OpenAI(base_url=app_url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S)
    outcomes = []

    def ask():
        try:
            outcomes.append(client.chat.completions.create(**CONSTRAINED))
        except openai.APIError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(crowd)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: checker.entered + len(outcomes) == crowd, what="each grammar request checked or refused")
        plain = client.with_options(timeout=HANG_GUARD_S / 2).chat.completions.create(**PLAIN)
        assert plain.choices[0].message.content == "ok"
        assert checker.entered == 1  # the one check thread; the rest never reached the checker
    finally:
        checker.release.set()
        for thread in threads:
            thread.join(HANG_GUARD_S)
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(refused) == crowd - 1 and len(outcomes) == crowd
    for exc in refused:
        assert isinstance(exc, openai.RateLimitError), exc
        assert exc.response.headers["retry-after"] == str(RETRY_AFTER_S)
        error = exc.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert "grammar" in error["message"]
    (served,) = [o for o in outcomes if not isinstance(o, Exception)]
    assert served.choices[0].message.content == "ok"


def test_checks_past_the_queue_are_refused_and_a_cancelled_wait_frees_its_place():
    checks = GrammarChecks(workers=1, queue=1)
    started, release = threading.Event(), threading.Event()
    ran = []

    def check(name):
        ran.append(name)
        started.set()
        assert release.wait(HANG_GUARD_S)
        return name

    async def scenario():
        first = asyncio.ensure_future(checks.run(check, "first"))
        second = asyncio.ensure_future(checks.run(check, "second"))
        await asyncio.sleep(0)  # one turn of the loop: both tasks are admitted (run() admits before it awaits)
        assert checks.admitted == 2
        with pytest.raises(APIError) as refused:
            await checks.run(check, "third")
        assert (refused.value.status, refused.value.body.code) == (429, "rate_limit_exceeded")
        assert await asyncio.to_thread(started.wait, HANG_GUARD_S)
        second.cancel()  # its client went away while it waited
        await asyncio.gather(second, return_exceptions=True)
        assert checks.admitted == 1
        fourth = asyncio.ensure_future(checks.run(check, "fourth"))
        await asyncio.sleep(0)
        assert checks.admitted == 2
        release.set()
        return await first, await fourth

    try:
        assert asyncio.run(scenario()) == ("first", "fourth")
    finally:
        release.set()
    assert ran == ["first", "fourth"] and checks.admitted == 0  # the cancelled check never ran


@pytest.mark.parametrize("workers, queue", [(0, 1), (1, -1)])
def test_bad_sizes_are_refused(workers, queue):
    with pytest.raises(ValueError):
        GrammarChecks(workers, queue)
