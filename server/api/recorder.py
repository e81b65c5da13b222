"""`lockstep serve --record DIR`: each answered request appended as one JSON line, for
`lockstep replay` (server/tools/replay.py) to send again and compare.

A line holds the endpoint, the request body as it was served (the seed the server drew and
the determinism it settled included, so sending it again asks for the same answer; never a
header, so never an API key) and, per choice, its finish reason, the answer's token ids and
its receipt. Files rotate by size (`requests.jsonl`, then `.1` … `.KEEP`). Recording never
fails a request: a directory that cannot be made or written is one warning, then nothing is
written until a write succeeds again (checked at most once a minute).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("lockstep.record")

FILE_NAME = "requests.jsonl"
DEFAULT_MAX_BYTES = 64 << 20  # per file, before it rotates
KEEP = 5  # rotated files kept beside the current one
RETRY_S = 60.0


class Recorder:
    def __init__(self, directory: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = KEEP):
        self.path = Path(directory) / FILE_NAME
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._failed_at: float | None = None
        self.written = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if self._failed_at is None:
            log.warning("cannot record requests in %s (%s): serving goes on without recording; "
                        "trying again every %.0f s", self.path.parent, exc.strerror or exc, RETRY_S)
        self._failed_at = time.monotonic()

    def write(self, entry: dict) -> None:
        """Append `entry` as one line; never raises."""
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_S:
            return
        line = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                self._rotate_if_full(len(line))
                with open(self.path, "ab") as f:
                    f.write(line)
            except OSError as exc:
                self._fail(exc)
                return
        if self._failed_at is not None:
            log.info("recording requests in %s again", self.path.parent)
            self._failed_at = None
        self.written += 1

    def _rotate_if_full(self, adding: int) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size + adding <= self.max_bytes:
            return
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{FILE_NAME}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{FILE_NAME}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{FILE_NAME}.1"))


def endpoint_of(body) -> str:
    from lockstep.server.api.chat_protocol import ChatCompletionRequest

    return "/v1/chat/completions" if isinstance(body, ChatCompletionRequest) else "/v1/completions"


def entry_for(body, finals) -> dict:
    """The line for `body` answered with each choice's final Delta `finals`."""
    return {
        "time": round(time.time(), 3),
        "endpoint": endpoint_of(body),
        "request": body.model_dump(mode="json", exclude_unset=True, by_alias=True),
        "choices": [{"index": i, "finish_reason": d.finish_reason,
                     "token_ids": list(d.token_ids or ()),
                     "receipt": d.report.receipt if d.report is not None else None} for i, d in enumerate(finals)],
    }


class RecordedHandle:
    """A choice's handle that hands its final Delta to the group when it passes."""

    def __init__(self, handle, group: "RecordedGroup", index: int):
        self._handle = handle
        self._group = group
        self._index = index
        self.request = handle.request

    def cancel(self) -> None:
        self._handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._handle.cancelled

    @property
    def queued(self) -> bool:
        return self._handle.queued

    async def __aiter__(self):
        async for delta in self._handle:
            if delta.finish_reason is not None:
                self._group.finished(self._index, delta)
            yield delta


class RecordedGroup:
    """A request's choices: once every one has finished, the request is written."""

    def __init__(self, recorder: Recorder, body, handles):
        self._recorder = recorder
        self._body = body
        self._finals: list = [None] * len(handles)
        self.handles = [RecordedHandle(h, self, i) for i, h in enumerate(handles)]

    def finished(self, index: int, delta) -> None:
        self._finals[index] = delta
        if all(d is not None for d in self._finals):
            self._recorder.write(entry_for(self._body, self._finals))
