"""How a model writes tool calls (its format), and a call's text back into an OpenAI tool call.

The format is the model's own where its chat template names one (docs/API.md, Tools):
- Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (mlx-lm's `json_tools`);
- Llama 3.x: the answer is the JSON `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), recognised only at the start of the output;
- Mistral: `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` (mlx-lm's `mistral`
  parser); no end tag: the calls run to the end of the output;
- gpt-oss: harmony messages; a call is a `commentary` message to `functions.NAME` whose text is
  the arguments (tool_call_stream.py `HarmonyStream`); only the `final` channel (and commentary
  preambles) is content;
- any other format mlx-lm has a parser for (its start/end tags and `parse_tool_call`).
Every other model gets lockstep's fallback: the tools are described in the system prompt and
calls are written between `<tool_call>` and `</tool_call>` lines. Constrained decoding
(tool_choice "required" or a named function) writes the format's own calls
(`ToolFormat.grammar_layout`), for the formats whose arguments are one JSON object.

Finding the calls in output as it arrives is tool_call_stream.py's job.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Callable

FALLBACK_START = "<tool_call>"
FALLBACK_END = "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"


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
        (server/engine/structured/grammar.py `tool_calls`); {} is `{"name": ..., "arguments": ...}`."""
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
        calls = [call_from(item, names) for item in found]
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


def call_from(call, names: set[str]) -> ParsedCall | None:
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
