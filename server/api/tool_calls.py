"""How a model writes tool calls, and turning its output text back into OpenAI `tool_calls`.

A call is `start + {"name": ..., "arguments": {...}} + end`. Models whose chat template and
tokenizer name a JSON call format (mlx-lm's `json_tools` parser) use their own tags; every
other model gets lockstep's fallback (docs/API.md): the tools are described in the system
prompt and calls are written between `<tool_call>` and `</tool_call>` lines, the format
many open models are trained on. Constrained decoding (tool_choice "required" or a named
function) writes exactly this shape, so even a small model then produces a valid call.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

FALLBACK_START = "<tool_call>"
FALLBACK_END = "</tool_call>"


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: str
    native: bool  # the chat template renders `tools` itself
    json_calls: bool  # calls are JSON objects between start and end (constrainable)

    def grammar_tags(self) -> tuple[str, str]:
        """The exact text constrained decoding writes around each call."""
        return self.start + "\n", "\n" + self.end


def tool_format(tokenizer) -> ToolFormat:
    template = getattr(tokenizer, "chat_template", None) or ""
    native = isinstance(template, str) and "tools" in template
    if getattr(tokenizer, "has_tool_calling", False):
        parser = getattr(tokenizer, "tool_parser", None)
        json_calls = getattr(parser, "__name__", "").endswith("json_tools") or tokenizer.tool_call_start == FALLBACK_START
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, native, json_calls)
    return ToolFormat(FALLBACK_START, FALLBACK_END, native, True)


def fallback_system_prompt(tools: list[dict]) -> str:
    """The tool instructions for models whose chat template does not render tools."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You may call one or more functions to assist with the user query.\n"
        "Function signatures are within <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        "To call a function, answer with a JSON object with the function name and arguments "
        "within <tool_call></tool_call> tags:\n"
        "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    )


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def parse_call(text: str, names: set[str]) -> ParsedCall | None:
    """One call's body, or None when it is not a JSON call of a known tool."""
    try:
        call = json.loads(text.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits output text, as it arrives, into content and complete calls.

    Text that might begin a call tag is held back until it is known not to; a call is
    reported once its end tag arrives (or at the end of output, if its body is valid JSON);
    the end tag's text inside a JSON string of the body does not end it (`_call_end`).
    A tagged body that is not a valid call of a known tool is passed on as content.
    """

    def __init__(self, fmt: ToolFormat, names: set[str], max_calls: int | None = None):
        self.fmt, self.names = fmt, names
        self.max_calls = max_calls  # 1 with parallel_tool_calls off: later calls are dropped
        self._pending = ""  # content held back, or an open call's text
        self._in_call = False
        self.calls: list[ParsedCall] = []

    def _keep(self, call: ParsedCall) -> list[ParsedCall]:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return []
        self.calls.append(call)
        return [call]

    def add(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content that can be sent now, and calls completed by `text`."""
        self._pending += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = _call_end(self._pending, self.fmt.end)
                if end < 0:
                    return content, calls
                body = self._pending[:end]
                self._pending = self._pending[end + len(self.fmt.end):]
                self._in_call = False
                call = parse_call(body, self.names)
                if call is None:
                    content += self.fmt.start + body + self.fmt.end
                else:
                    calls += self._keep(call)
                continue
            start = self._pending.find(self.fmt.start)
            if start >= 0:
                before = self._pending[:start]
                if before.strip() or not self.calls:  # whitespace between calls is no content
                    content += before
                self._pending = self._pending[start + len(self.fmt.start):]
                self._in_call = True
                continue
            keep = _partial_tag_suffix(self._pending, self.fmt.start)
            if self.calls and not self._pending[:len(self._pending) - keep].strip():
                return content, calls  # whitespace between calls: sent only if text follows
            content += self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of output: what is still held back."""
        pending, self._pending = self._pending, ""
        if not self._in_call:
            return ("" if self.calls and not pending.strip() else pending), []
        self._in_call = False
        cut = _partial_tag_suffix(pending, self.fmt.end)  # output that stopped inside the end tag
        call = parse_call(pending[:len(pending) - cut], self.names)
        if call is None:
            return self.fmt.start + pending, []
        return "", self._keep(call)


    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        """A whole output: its content (outside calls) and its calls."""
        content, calls = self.add(text)
        rest, more = self.finish()
        return content + rest, calls + more


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
    return ToolCallStream(fmt, names, max_calls).split(text)
