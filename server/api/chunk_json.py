"""A streamed event's JSON without building its objects per token.

Most events of a stream differ only in their text and one number (a chat chunk's `created`
second, a Responses event's `sequence_number`). `EventTemplate` renders the event once, with
marker values in those two fields, and keeps the JSON around them; each token then fills in
the number and the text, the text serialized as the renderer serializes it. `ChunkTemplate`
is the chat/completions chunk's (pydantic's `model_dump_json`); /v1/responses and
/v1/messages build theirs for their text deltas. The bytes are the renderer's
(tests/test_chunk_json.py holds the two side by side).
"""
from __future__ import annotations

import time
from typing import Callable

import pydantic_core

from lockstep.server.api.response_bodies import ResponseBody

# Marker values, rendered once: an int no number reaches and a string no model writes.
_NUMBER = 9_087_123_456_789
_TEXT = "\x00lockstep chunk text\x00"


def pydantic_text(text: str) -> str:
    """A string as pydantic's model_dump_json writes it."""
    return pydantic_core.to_json(text).decode()


class EventTemplate:
    """`render_once(number, text)` -> the event's JSON (`number` None: it has none);
    `fill(text, number)` is then `render_once(number, text)`, from the parts kept. `text_json`
    serializes a string as `render_once` does. `number_field`: the number's key, found as
    `"key":<number>` before the text."""

    def __init__(self, render_once: Callable[[int | None, str], str], text_json: Callable[[str], str] = pydantic_text,
                 number_field: str | None = None):
        self._text_json = text_json
        rendered = render_once(_NUMBER if number_field else None, _TEXT)
        text = text_json(_TEXT)
        if rendered.count(text) != 1:
            raise ValueError("an event template needs the text once")
        if number_field:
            number = f'"{number_field}":{_NUMBER}'
            if rendered.count(number) != 1 or rendered.find(number) > rendered.find(text):
                raise ValueError(f"an event template needs `{number_field}` once, then the text once")
            head, rest = rendered.split(number)
            self._head = head + f'"{number_field}":'
        else:
            self._head, rest = "", rendered
        self._numbered = bool(number_field)
        self._middle, self._tail = rest.split(text)

    def fill(self, text: str, number: int = 0) -> str:
        count = number if self._numbered else ""
        return f"{self._head}{count}{self._middle}{self._text_json(text)}{self._tail}"


class ChunkTemplate:
    """`build(created, text)` -> the chunk (a pydantic model) whose JSON this renders; `render(text)`
    is then `build(int(time.time()), text).model_dump_json()`."""

    def __init__(self, build: Callable[[int, str], ResponseBody]):
        self._event = EventTemplate(lambda created, text: build(created, text).model_dump_json(),
                                    number_field="created")

    def render(self, text: str) -> str:
        return self._event.fill(text, int(time.time()))
