"""A streamed chunk's JSON without building its pydantic objects per token.

Most chunks of a stream differ only in their text and their `created` second. `ChunkTemplate`
renders the chunk once through pydantic with marker values in those two fields and keeps the
JSON around them; each token then fills in the second and the text, the text serialized by
pydantic-core as `model_dump_json` serializes it. The bytes are `model_dump_json`'s
(tests/test_chunk_json.py holds the two side by side).
"""
from __future__ import annotations

import time
from typing import Callable

import pydantic_core

from lockstep.server.api.response_bodies import ResponseBody

# Marker values, rendered once: an int no `created` second reaches and a string no model writes.
_CREATED = 9_087_123_456_789
_TEXT = "\x00lockstep chunk text\x00"


class ChunkTemplate:
    """`build(created, text)` -> the chunk (a pydantic model) whose JSON this renders; `render(text)`
    is then `build(int(time.time()), text).model_dump_json()`."""

    def __init__(self, build: Callable[[int, str], ResponseBody]):
        rendered = build(_CREATED, _TEXT).model_dump_json()
        created = f'"created":{_CREATED}'
        text = pydantic_core.to_json(_TEXT).decode()
        if rendered.count(created) != 1 or rendered.count(text) != 1 or rendered.find(created) > rendered.find(text):
            raise ValueError("a chunk template needs `created` once, then the text once")
        head, rest = rendered.split(created)
        self._head = head + '"created":'
        self._middle, self._tail = rest.split(text)

    def render(self, text: str) -> str:
        return f"{self._head}{int(time.time())}{self._middle}{pydantic_core.to_json(text).decode()}{self._tail}"
