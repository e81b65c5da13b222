"""The errors a submission or a generation can end in (the API maps each to its status).

Kept apart from everything else in the engine, so any module may raise them without
importing the request machinery.
"""
from __future__ import annotations


class GenerationError(Exception):
    """Generation failed on the worker; the message is safe to show to the client."""


class QueueFull(GenerationError):
    """`submit()` refused: `max_waiting` requests are already waiting (the API answers 429)."""


class ShuttingDown(GenerationError):
    """The server stopped this request (drain timeout or a second signal); the API answers 503."""


class TooLargeForMemory(GenerationError):
    """`submit()` refused: the request's KV alone exceeds the server's budget (400)."""


class RequestInvalid(GenerationError):
    """Generation stopped by what the request itself asked for, not by the server (e.g. its
    output grammar hit a grammar-engine limit mid-output): a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
