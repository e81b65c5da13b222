"""server/api/request_record.py: what a request's record says about how it ended."""
import asyncio
from types import SimpleNamespace

import pytest

from lockstep.server.api.access_log import access_line
from lockstep.server.api.request_record import RequestRecord, TrackedHandle
from lockstep.server.engine import GenerationError


class FailingHandle:
    """An engine handle whose generation fails after one token (e.g. the device ran out of memory)."""

    request = SimpleNamespace(prompt_tokens=[1, 2, 3])
    plan = None
    cancelled = False

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        yield SimpleNamespace(completion_tokens=1, prompt_tokens=3, finish_reason=None)
        raise GenerationError("generation failed: RuntimeError: out of memory")


def test_a_failed_generation_is_logged_as_an_error_not_a_cancel():
    record = RequestRecord("r1", "POST", "/v1/chat/completions")
    tracked = TrackedHandle(FailingHandle(), record)

    async def consume():
        with pytest.raises(GenerationError):
            async for _ in tracked:
                pass
        tracked.cancel()  # as the routes do once the error event is sent

    asyncio.run(consume())
    assert record.finish_reason == "error" and not record.cancelled
    assert '"finish_reason": "error"' in access_line(record)
