"""Splitting a model's output, as it arrives, into content and tool calls (the formats:
tool_calls.py): text that might open a call is held back until it is known not to.

A call the output ends inside (cut off by max_tokens, or never closed) is no call: it is dropped,
never passed on as content.
"""
from __future__ import annotations

import json
import re

from lockstep.server.api.tool_calls import LLAMA_PYTHON_TAG, ParsedCall, ToolFormat, call_from

_LLAMA_CALL = re.compile(r'\{\s*"name"\s*:')


def call_stream(fmt: ToolFormat, names: set[str], max_calls: int | None = None,
                tools: list[dict] | None = None) -> "ToolCallStream | HarmonyStream":
    """What splits one output of `fmt` into content and calls, as it arrives."""
    kind = HarmonyStream if fmt.name == "gpt_oss" else ToolCallStream
    return kind(fmt, names, max_calls, tools)


class ToolCallStream:
    """Splits output text, as it arrives, into content and complete calls.

    Text that might begin a call is held back until it is known not to; a call is reported
    once its end tag arrives (or at the end of output, where the format has no end tag or the
    output ended inside the call and its text is still a valid call); the end tag's text inside
    a JSON string of the body does not end it (`_call_end`). A closed body that is no valid
    call of a known tool is passed on as content (as is a whole body of a format without end
    tag); a call the output ends inside that is no valid call is dropped (cut off: not content
    either).
    """

    def __init__(self, fmt: ToolFormat, names: set[str], max_calls: int | None = None,
                 tools: list[dict] | None = None):
        self.fmt, self.names, self.tools = fmt, names, tools
        self.max_calls = max_calls  # 1 with parallel_tool_calls off: later calls are dropped
        self._pending = ""  # content held back, or an open call's text
        self._opened: str | None = None  # the text that opened the call being read (None: none is)
        self._released = False  # content was sent: a llama3_json call can only open the output
        self.calls: list[ParsedCall] = []
        self.cut_off = False  # the output ended inside a call, which was dropped

    def _keep(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        kept = []
        for call in calls:
            if self.max_calls is None or len(self.calls) < self.max_calls:
                self.calls.append(call)
                kept.append(call)
        return kept

    def _find_start(self) -> tuple[int, int, int]:
        """(where a call opens in the pending text, the length of what opens it, 0), or
        (-1, 0, how many trailing characters may still open one)."""
        text = self._pending
        if self.fmt.name != "llama3_json":
            start = text.find(self.fmt.start)
            return (start, len(self.fmt.start), 0) if start >= 0 else (-1, 0, _partial_tag_suffix(text, self.fmt.start))
        if self._released or self.calls:
            return -1, 0, 0
        rest = text.lstrip()
        lead = len(text) - len(rest)
        if rest.startswith(LLAMA_PYTHON_TAG):
            return lead, len(LLAMA_PYTHON_TAG), 0
        if _LLAMA_CALL.match(rest):
            return lead, 0, 0  # the JSON is the call's text
        return (-1, 0, len(text)) if _may_open_llama_call(rest) else (-1, 0, 0)

    def add(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content that can be sent now, and calls completed by `text`."""
        self._pending += text
        content, calls = "", []
        while True:
            if self._opened is not None:
                end = _call_end(self._pending, self.fmt.end) if self.fmt.end else -1
                if end < 0:
                    return content, calls
                body = self._pending[:end]
                self._pending = self._pending[end + len(self.fmt.end):]
                opened, self._opened = self._opened, None
                parsed = self.fmt.parse(body, self.names, self.tools)
                if parsed is None:
                    content += opened + body + self.fmt.end
                else:
                    calls += self._keep(parsed)
                continue
            start, length, keep = self._find_start()
            if start >= 0:
                before = self._pending[:start]
                if before.strip() or not self.calls:  # whitespace between calls is no content
                    content += before
                self._opened = self._pending[start:start + length]
                self._pending = self._pending[start + length:]
                continue
            released = self._pending[:len(self._pending) - keep]
            if self.calls and not released.strip():
                return content, calls  # whitespace between calls: sent only if text follows
            content += released
            self._released = self._released or bool(released)
            self._pending = self._pending[len(self._pending) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of output: what is still held back, and the last call if it is one."""
        if self._opened is None:
            keep = self._find_start()[2]  # the output ended inside a start tag: a cut-off call
            text, self._pending = self._pending[:len(self._pending) - keep], ""
            self.cut_off = keep > 0
            return ("" if self.calls and not text.strip() else text), []
        pending, opened, self._pending, self._opened = self._pending, self._opened, "", None
        cut = _partial_tag_suffix(pending, self.fmt.end) if self.fmt.end else 0  # stopped inside the end tag
        body = pending[:len(pending) - cut]
        parsed = self.fmt.parse(body, self.names, self.tools, cut=not self.fmt.end)
        if parsed is not None:
            return "", self._keep(parsed)
        if not self.fmt.end and self.fmt.whole(body, self.tools):  # complete, but no call (Llama's JSON answer)
            return opened + body, []
        self.cut_off = True
        return "", []

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """A whole output: its content (outside calls) and its calls."""
        content, calls = self.add(text)
        rest, more = self.finish()
        return content + rest, calls + more


def _may_open_llama_call(text: str) -> bool:
    """`text` (the output so far, stripped) could still grow into a Llama call's opening."""
    if LLAMA_PYTHON_TAG.startswith(text):
        return True
    if not text.startswith("{"):
        return False
    rest = text[1:].lstrip()
    return '"name"'.startswith(rest) or (rest.startswith('"name"') and not rest[6:].strip())


# gpt-oss's harmony format: each message is a header (`<|channel|>NAME`, a recipient
# `to=functions.NAME`, a content type) and `<|message|>` text ending at <|end|>, <|call|>
# (a call: the tool answers next) or <|return|> (the answer is done).
HARMONY_MESSAGE, HARMONY_END, HARMONY_CALL, HARMONY_RETURN = "<|message|>", "<|end|>", "<|call|>", "<|return|>"
_HARMONY_HEADER_STARTS = ("<|channel|>", "<|start|>", "to=", "<|constrain|>")
_HARMONY_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyStream:
    """`ToolCallStream` for gpt-oss: content is the text of `final` messages (and of
    `commentary` ones to no recipient, which the format shows the user); `analysis` messages
    (the model's reasoning) are not content; a message to `functions.NAME` is a call of NAME
    whose text is its JSON arguments, reported when it ends (<|call|>, <|end|> or the end of
    output). Output that does not open as harmony is all content."""

    MARKERS = (HARMONY_END, HARMONY_CALL, HARMONY_RETURN)

    def __init__(self, fmt: ToolFormat, names: set[str], max_calls: int | None = None,
                 tools: list[dict] | None = None):
        self.fmt, self.names, self.max_calls = fmt, names, max_calls
        self._pending = ""
        self._header: str | None = ""  # the header being read (None: in a message's text)
        self._kind, self._function, self._arguments = "", "", ""
        self._plain = False  # the output is not harmony: all of it is content
        self._done = False  # <|call|> or <|return|> ended the turn: nothing after it counts
        self._first = True  # still in the output's first header
        self.calls: list[ParsedCall] = []
        self.cut_off = False  # the output ended inside a call, which was dropped

    def add(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._pending += text
        content, calls = "", []
        while not self._done:
            if self._plain:
                content, self._pending = content + self._pending, ""
                break
            if self._header is not None:
                at = self._pending.find(HARMONY_MESSAGE)
                if at < 0:
                    if self._first and not _may_open_harmony(self._pending):
                        self._plain = True
                        continue
                    break  # the header is not complete yet
                self._open(self._pending[:at])
                self._pending = self._pending[at + len(HARMONY_MESSAGE):]
                continue
            at, marker = min(((self._pending.find(m), m) for m in self.MARKERS if m in self._pending),
                             default=(-1, ""))
            if at < 0:
                keep = max(_partial_tag_suffix(self._pending, m) for m in self.MARKERS)
                content += self._text(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content += self._text(self._pending[:at])
            self._pending = self._pending[at + len(marker):]
            calls += self._close()
            self._header, self._done = "", marker != HARMONY_END
        if self._done:
            self._pending = ""  # what a model writes after its turn ended (a made-up tool answer)
        return content, calls

    def _open(self, header: str) -> None:
        self._first = False
        self._header = None
        recipient = _HARMONY_RECIPIENT.search(header)
        channel = _HARMONY_CHANNEL.search(header)
        self._arguments = ""
        if recipient is not None:
            self._kind, self._function = "call", recipient.group(1)
        else:
            self._kind = "hidden" if channel is not None and channel.group(1) == "analysis" else "content"

    def _text(self, text: str) -> str:
        if self._kind == "call":
            self._arguments += text
            return ""
        return text if self._kind == "content" else ""

    def _close(self) -> list[ParsedCall]:
        kind, self._kind = self._kind, ""
        if kind != "call" or not self._function.startswith("functions."):
            return []
        try:
            call = call_from({"name": self._function[len("functions."):],
                               "arguments": json.loads(self._arguments)}, self.names)
        except ValueError:
            call = None
        if call is None or (self.max_calls is not None and len(self.calls) >= self.max_calls):
            return []
        self.calls.append(call)
        return [call]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self._done or (self._header is not None and not self._plain):
            # a header the output ended in opens no text (nor a call, where it names a recipient)
            self.cut_off = not self._done and _HARMONY_RECIPIENT.search(self._pending) is not None
            self._pending = ""
            return "", []
        if self._plain:
            text, self._pending = self._pending, ""
            return text, []
        keep = max(_partial_tag_suffix(self._pending, m) for m in self.MARKERS)
        text = self._text(self._pending[:len(self._pending) - keep])
        self._pending = ""
        self._done = True
        calling = self._kind == "call"
        calls = self._close()  # a message the output ended in (eos is never text)
        self.cut_off = calling and not calls
        return text, calls

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        content, calls = self.add(text)
        rest, more = self.finish()
        return content + rest, calls + more


def _may_open_harmony(text: str) -> bool:
    text = text.lstrip()
    return any(text.startswith(m) or m.startswith(text) for m in _HARMONY_HEADER_STARTS)


def _call_end(body: str, end_tag: str) -> int:
    """Where the end tag that closes a call starts in `body` (the text after its start tag),
    or -1 while it has not arrived.

    A JSON body ends at the first end tag outside its strings: an argument's text may contain
    the tag (`{"note": "</tool_call>"}`), and cutting there would lose the call. Any other
    body ends at the first end tag (it is passed on as content).
    """
    start = len(body) - len(body.lstrip())
    if start == len(body) or body[start] != "{":
        return body.find(end_tag)
    in_string = escaped = False
    for i in range(start, len(body)):
        char = body[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif body.startswith(end_tag, i):
            return i
    return -1


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def split_tool_calls(text: str, fmt: ToolFormat, names: set[str],
                     max_calls: int | None = None) -> tuple[str, list[ParsedCall]]:
    """A whole output: its content (outside calls) and its calls."""
    return call_stream(fmt, names, max_calls).split(text)
