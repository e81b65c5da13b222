"""How a model writes tool calls, and turning its output text back into OpenAI `tool_calls`.

The format is the model's own where its chat template names one (docs/API.md, Tools):
- Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (mlx-lm's `json_tools`);
- Llama 3.x: the answer is the JSON `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), recognised only at the start of the output;
- Mistral: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` (mlx-lm's `mistral`
  parser); no end tag: the calls run to the end of the output;
- gpt-oss: harmony messages; a call is a `commentary` message to `functions.NAME` whose text is
  the arguments (`HarmonyStream`); only the `final` channel (and commentary preambles) is content;
- any other format mlx-lm has a parser for (its start/end tags and `parse_tool_call`).
Every other model gets lockstep's fallback: the tools are described in the system prompt and
calls are written between `<tool_call>` and `</tool_call>` lines. Constrained decoding
(tool_choice "required" or a named function) writes the format's own calls
(`ToolFormat.grammar_layout`), for the formats whose arguments are one JSON object.

A call the output ends inside (cut off by max_tokens, or never closed) is no call: it is dropped,
never passed on as content.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

FALLBACK_START = "<tool_call>"
FALLBACK_END = "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
_LLAMA_CALL = re.compile(r'\{\s*"name"\s*:')


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "fallback", "json_tools", "llama3_json", "mistral", "gpt_oss" or another mlx-lm parser's
    start: str  # the text that opens a call ("" for llama3_json: a call is recognised by its JSON)
    end: str  # the text that closes it ("": the calls run to the end of the output)
    native: bool  # the chat template renders `tools` itself
    json_calls: bool = True  # the arguments are one JSON object: constrained decoding can write calls
    parser: Callable | None = field(default=None, compare=False)  # mlx-lm's parse_tool_call, where used
    max_calls: int | None = None  # calls one answer can hold in this format (its template renders one)
    header_calls: bool = False  # mistral: `name[ARGS]{...}` after each [TOOL_CALLS], not a JSON list
    stop: str = ""  # text that ends the turn after a call (gpt-oss's <|call|>: the tool answers next)

    def grammar_tags(self) -> tuple[str, str]:
        """The exact text constrained decoding writes around each call."""
        if self.name in ("fallback", "json_tools"):
            return self.start + "\n", "\n" + self.end
        if self.name == "mistral" and self.header_calls:
            return self.start, ""
        return "", ""

    def grammar_layout(self) -> dict:
        """How constrained decoding writes a call's name and arguments, and joins calls
        (server/engine/grammar.py `tool_calls`); {} is `{"name": ..., "arguments": ...}`."""
        if self.name == "llama3_json":
            return {"arguments_prefix": ', "parameters": '}
        if self.name == "mistral" and self.header_calls:
            return {"name_prefix": "", "name_json": False, "arguments_prefix": "[ARGS]", "arguments_suffix": "",
                    "separator": ""}
        if self.name == "mistral":
            return {"open": self.start + "[", "close": "]", "separator": ", "}
        if self.name == "gpt_oss":  # ends at the grammar's end, where the model would write <|call|>
            return {"name_prefix": "<|channel|>commentary to=functions.", "name_json": False,
                    "arguments_prefix": " <|constrain|>json<|message|>", "arguments_suffix": ""}
        return {}

    def parse(self, body: str, names: set[str], tools: list[dict] | None = None,
              cut: bool = False) -> list[ParsedCall] | None:
        """The calls in one call's text (between start and end), or None when it holds no valid
        call of a known tool (all of them must be valid). `cut`: the output ended inside `body`
        (a format whose calls run to the end of the output): the complete calls before the cut
        count, the one it cut does not."""
        found = self._parse(body, tools)
        if found is None and cut:
            found = self._complete_calls(body, tools)
        if found is None:
            return None
        found = found if isinstance(found, list) else [found]
        calls = [_call_from(item, names) for item in found]
        return calls if calls and None not in calls else None

    def whole(self, body: str, tools: list[dict] | None = None) -> bool:
        """`body` parses in this format (though maybe as no call of a known tool): for a format
        without end tag, a body the model ended itself rather than one cut off."""
        return self._parse(body, tools) is not None

    def _parse(self, body: str, tools: list[dict] | None):
        if self.name == "llama3_json":
            return _json_sequence(body[len(LLAMA_PYTHON_TAG):] if body.startswith(LLAMA_PYTHON_TAG) else body)
        if self.parser is not None:
            try:
                return self.parser(body, tools)
            except Exception:  # mlx-lm's parsers raise ValueError, JSONDecodeError, SyntaxError...
                return None
        try:
            return json.loads(body.strip())
        except ValueError:
            return None

    def _complete_calls(self, body: str, tools: list[dict] | None) -> list | None:
        """The calls of a cut-off multi-call body that were complete before the cut."""
        if self.name == "llama3_json":
            return _json_sequence(body[len(LLAMA_PYTHON_TAG):] if body.startswith(LLAMA_PYTHON_TAG) else body,
                                  complete_only=True)
        if self.name == "mistral" and self.header_calls:  # each call after its own [TOOL_CALLS]
            calls = []
            for piece in body.split(self.start):
                found = self._parse(piece, tools)
                if found is None:
                    break
                calls += found if isinstance(found, list) else [found]
            return calls or None
        if self.name == "mistral":  # the elements of a JSON list before the one cut off
            rest = body.lstrip()
            return _json_sequence(rest[1:], separator=",", complete_only=True) if rest.startswith("[") else None
        return None


def tool_format(tokenizer) -> ToolFormat:
    """The model's call format, from its chat template and mlx-lm's inference from it."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    native = "tools" in template
    if not native:  # the fallback prompt asks for fallback tags, whatever the tokenizer knows
        return ToolFormat("fallback", FALLBACK_START, FALLBACK_END, False)
    if "<|channel|>" in template and "<|call|>" in template:  # harmony: mlx-lm has no parser for it
        return ToolFormat("gpt_oss", "<|channel|>", "<|call|>", native, max_calls=1, stop="<|call|>")
    if getattr(tokenizer, "has_tool_calling", False):
        parser = tokenizer.tool_parser
        kind = getattr(parser, "__module__", "").rsplit(".", 1)[-1]  # mlx_lm.tool_parsers.<kind>
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        if kind == "json_tools":
            return ToolFormat("json_tools", start, end, native)
        if kind == "mistral":
            return ToolFormat("mistral", start, end, native, parser=parser, header_calls="[ARGS]" in template)
        return ToolFormat(kind or "mlx_lm", start, end, native, json_calls=False, parser=parser)
    # Llama 3.x: "Respond in the format {"name": function name, "parameters": ...}" (no tags)
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return ToolFormat("llama3_json", "", "", native, max_calls=1)
    return ToolFormat("fallback", FALLBACK_START, FALLBACK_END, native)


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


def mistral_call_id(call_id: str) -> str:
    """Mistral's templates take only 9-character alphanumeric call ids: another id is rendered as
    one derived from it, the same for a call and its result."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _call_from(call, names: set[str]) -> ParsedCall | None:
    """A parsed call object ({"name", "arguments" or "parameters"}) of a known tool, or None."""
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


def parse_call(text: str, names: set[str]) -> ParsedCall | None:
    """One JSON call's body, or None when it is not a JSON call of a known tool."""
    try:
        return _call_from(json.loads(text.strip()), names)
    except ValueError:
        return None


def _json_sequence(text: str, separator: str = ";", complete_only: bool = False) -> list | None:
    """JSON values separated by `separator` and whitespace (Llama's several calls), or None;
    `complete_only`: the values before the first that does not parse (the output was cut)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (values and text[i] == separator)):
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return (values or None) if complete_only else None
        values.append(value)


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
            return ("" if self.calls and not text.strip() else text), []
        pending, opened, self._pending, self._opened = self._pending, self._opened, "", None
        cut = _partial_tag_suffix(pending, self.fmt.end) if self.fmt.end else 0  # stopped inside the end tag
        body = pending[:len(pending) - cut]
        parsed = self.fmt.parse(body, self.names, self.tools, cut=not self.fmt.end)
        if parsed is not None:
            return "", self._keep(parsed)
        if not self.fmt.end and self.fmt.whole(body, self.tools):  # complete, but no call (Llama's JSON answer)
            return opened + body, []
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
            call = _call_from({"name": self._function[len("functions."):],
                               "arguments": json.loads(self._arguments)}, self.names)
        except ValueError:
            call = None
        if call is None or (self.max_calls is not None and len(self.calls) >= self.max_calls):
            return []
        self.calls.append(call)
        return [call]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self._done or (self._header is not None and not self._plain):
            self._pending = ""  # a header the output ended in opens no text
            return "", []
        if self._plain:
            text, self._pending = self._pending, ""
            return text, []
        keep = max(_partial_tag_suffix(self._pending, m) for m in self.MARKERS)
        text = self._text(self._pending[:len(self._pending) - keep])
        self._pending = ""
        self._done = True
        return text, self._close()  # a message the output ended in (eos is never text)

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
