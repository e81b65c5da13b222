"""Stop work whose client has gone: race an awaitable against the HTTP disconnect event.

Streamed responses notice a disconnect when a write fails (Starlette cancels the stream);
a non-streamed request only writes at the end, so without this its generation would run
to completion for nobody.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from lockstep.server.api.errors import APIError
from lockstep.server.api.request_record import CLIENT_CLOSED_REQUEST

T = TypeVar("T")


class ClientDisconnected(APIError):
    def __init__(self):
        super().__init__(CLIENT_CLOSED_REQUEST, "The client closed the connection", code="client_closed_request")


async def _disconnected(receive) -> None:
    # Called after the body was read: the next event the server sends is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(awaitable: Awaitable[T], receive) -> T:
    """The result of `awaitable`, or `ClientDisconnected` (it cancelled) if the client left first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work in done:
        return work.result()
    raise ClientDisconnected()
