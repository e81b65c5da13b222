"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens.

A Messages request runs as the chat request it translates to (`chat_request`), as
/v1/responses does: prompt building, limits, grammars (a forced tool), tool-call parsing and
the determinism plan are the chat path's. `ContentBlocks` turns the output text into
Anthropic's content blocks (text first, then tool_use blocks) and the stream events that
announce them; the non-streamed message is built by the same code, so the two agree. Errors
come in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), in a stream as
an `error` event.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from lockstep.server.api import choices
from lockstep.server.api import messages_protocol as mp
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.chunk_json import EventTemplate
from lockstep.server.api.errors import APIError, generation_error, validation_text
from lockstep.server.api.tool_call_stream import ToolCallStream
from lockstep.server.api.tool_calls import ParsedCall, new_call_id
from lockstep.server.engine import GenerationError
from lockstep.server.engine.generate import Delta
from lockstep.server.engine.decoding.request_report import rendered

# Chat-request fields named in errors from the shared submission path -> the Messages field.
PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}
# Anthropic's SDKs stream text as it comes; a ping keeps idle proxies from closing the stream.
PING = mp.event("ping")


# ----------------------------------------------------------------------------- request

def _user_turn(blocks: list) -> list[dict]:
    """A user turn: its tool results become tool messages (in order), its text one user message."""
    messages, text = [], []
    for block in blocks:
        if isinstance(block, mp.ToolResultBlock):
            content = block.text()
            if block.is_error:
                content = f"Error: {content}"
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, mp.TextBlock):
            text.append(block.text)
    if text:
        messages.append({"role": "user", "content": "\n\n".join(text)})
    return messages


def _assistant_turn(blocks: list) -> list[dict]:
    text = "".join(b.text for b in blocks if isinstance(b, mp.TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, mp.ToolUseBlock)]
    if not calls:
        return [{"role": "assistant", "content": text}]
    return [{"role": "assistant", "content": text or None, "tool_calls": calls}]


def _chat_messages(body: mp.MessagesRequest | mp.CountTokensRequest) -> list[dict]:
    system = body.system if isinstance(body.system, str) or body.system is None \
        else "\n\n".join(block.text for block in body.system)
    messages = [{"role": "system", "content": system}] if system is not None else []
    for message in body.messages:
        turn = _user_turn if message.role == "user" else _assistant_turn
        messages += turn(message.blocks())
    return messages


def _tool_choice(choice) -> tuple[object, bool]:
    """Anthropic's tool_choice -> chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, True
    parallel = not getattr(choice, "disable_parallel_tool_use", None)
    if isinstance(choice, mp.ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(body: mp.MessagesRequest | mp.CountTokensRequest) -> ChatCompletionRequest:
    """The /v1/chat/completions request that generates `body`'s answer."""
    tool_choice, parallel = _tool_choice(body.tool_choice)
    tools = [{"type": "function", "function": {k: v for k, v in {
        "name": t.name, "description": t.description, "parameters": t.input_schema}.items() if v is not None}}
        for t in body.tools] if body.tools else None
    fields = {"model": body.model, "messages": _chat_messages(body), "tools": tools,
              "tool_choice": tool_choice if tools else None, "parallel_tool_calls": parallel}
    if isinstance(body, mp.MessagesRequest):
        schema = body.output_config.format if body.output_config else None
        fields.update({
            "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema.schema_}}
            if schema is not None else None,
            "max_completion_tokens": body.max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_k": body.top_k or 0,
            "stop": body.stop_sequences or None,
            "user": body.metadata.user_id if body.metadata else None,
            "seed": body.seed, "speculative": body.speculative,
            "num_draft_tokens": body.num_draft_tokens,
        })
    if not tools:
        fields.pop("parallel_tool_calls")
    if "deterministic" in body.model_fields_set:  # unsent: the model name or the deployment decides
        fields["deterministic"] = body.deterministic
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = error["loc"][0] if error["loc"] else None
        param = PARAMS.get(field, field) if isinstance(field, str) else None
        raise APIError(400, f"{param}: {validation_text(error)}" if param else validation_text(error),
                       param=param) from None


def parse(model, raw: bytes):
    """`raw` as `model` (MessagesRequest / CountTokensRequest), or an APIError naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # the deepest error is the one that names the bad part (a union reports each branch)
        error = max(exc.errors(), key=lambda e: len(e["loc"]))
        where = ".".join(str(part) for part in error["loc"] if not _union_tag(part))
        raise APIError(400, f"{where}: {validation_text(error)}" if where else validation_text(error),
                       param=where or None) from None


def _union_tag(part) -> bool:
    """A union branch's name in a pydantic error location (not a field of the request)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "unsupported"))


def anthropic_error(exc: APIError) -> JSONResponse:
    return JSONResponse(mp.error_body(exc.status, exc.body.message), status_code=exc.status, headers=exc.headers)


# ----------------------------------------------------------------------------- output

def stop_reason(final: Delta, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished answer."""
    if called:
        return "tool_use", None
    if final.finish_reason == "length":
        return "max_tokens", None
    if final.stop_sequence is not None:
        return "stop_sequence", final.stop_sequence
    return "end_turn", None


class ContentBlocks:
    """An answer's content blocks built from its text as it arrives, and their stream events.

    The text block opens when there is text to show (leading whitespace is held, so a model that
    only calls a tool gets no empty text block); tool_use blocks follow it at the end, where a
    whole-text parse puts them too.
    """

    def __init__(self, calls: ToolCallStream | None):
        self.blocks: list[mp.OutputText | mp.OutputToolUse] = []
        self._calls_stream = calls
        self._calls: list[ParsedCall] = []
        self._text: mp.OutputText | None = None
        self._delta_event: EventTemplate | None = None  # the open text block's deltas
        self._held = ""

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def add(self, text: str) -> list[str]:
        if self._calls_stream is not None:
            text, calls = self._calls_stream.add(text)
            self._calls += calls
        return self._add_text(text)

    def finish(self) -> list[str]:
        events = []
        if self._calls_stream is not None:
            rest, calls = self._calls_stream.finish()
            self._calls += calls
            events += self._add_text(rest)
        if self._text is None and not self._calls:  # an answer with no text is still a text block
            held, self._held = self._held, ""
            events += self._open_text() + self._delta(held)
        if self._text is not None:
            events.append(mp.event("content_block_stop", index=self.blocks.index(self._text)))
            self._text = None
        for call in self._calls:
            events += self._tool_use(call)
        return events

    def _add_text(self, text: str) -> list[str]:
        if self._text is not None:
            return self._delta(text)
        self._held += text
        if not self._held.strip():
            return []
        held, self._held = self._held, ""
        return self._open_text() + self._delta(held)

    def _open_text(self) -> list[str]:
        self._text = mp.OutputText()
        self.blocks.append(self._text)
        index = len(self.blocks) - 1
        self._delta_event = delta_template(index)
        return [mp.event("content_block_start", index=index, content_block={"type": "text", "text": ""})]

    def _delta(self, text: str) -> list[str]:
        if not text:
            return []
        self._text.text += text
        return [self._delta_event.fill(text)]

    def _tool_use(self, call: ParsedCall) -> list[str]:
        block = mp.OutputToolUse(id=new_call_id().replace("call_", "toolu_", 1), name=call.name,
                                 input=mp.tool_input(call.arguments))
        self.blocks.append(block)
        index = len(self.blocks) - 1
        return [mp.event("content_block_start", index=index,
                         content_block={"type": "tool_use", "id": block.id, "name": block.name, "input": {}}),
                mp.event("content_block_delta", index=index,
                         delta={"type": "input_json_delta", "partial_json": json.dumps(block.input)}),
                mp.event("content_block_stop", index=index)]


def delta_template(index: int) -> EventTemplate:
    """A text block's content_block_delta events as `mp.event` frames them, built once per block
    (a stream's most frequent event builds and encodes no dict)."""
    return EventTemplate(lambda _, text: mp.event("content_block_delta", index=index,
                                                  delta={"type": "text_delta", "text": text}),
                         text_json=lambda text: json.dumps(text, ensure_ascii=False))


# ----------------------------------------------------------------------------- route

class MessagesRoute:
    """/v1/messages on top of the chat route's submission (`models.use(name)` gives the named
    model's `Submissions`, server/api/submission.py)."""

    def __init__(self, models):
        self.models = models

    async def create(self, raw: bytes, receive=None):
        try:
            body = parse(mp.MessagesRequest, raw)
            chat = chat_request(body)
            async with self.models.use(chat.model) as submissions:
                handles = await submissions.submit_chat(chat)
        except APIError as exc:
            exc.body.param = PARAMS.get(exc.body.param, exc.body.param)
            exc.body.message = _renamed(exc.body.message)
            return anthropic_error(exc)
        blocks = ContentBlocks(submissions.tool_calls_stream(chat))
        message = mp.Message(id=mp.new_id("msg"), model=submissions.name,
                             usage=mp.Usage(input_tokens=0, output_tokens=0))
        if not body.stream:
            try:
                final = (await submissions.collect(handles, receive))[0]
            except APIError as exc:
                return anthropic_error(exc)
            blocks.add(final.text)
            blocks.finish()
            return JSONResponse(self._finished(message, blocks, final).model_dump())
        return StreamingResponse(self._stream(handles, message, blocks), media_type="text/event-stream")

    async def count_tokens(self, raw: bytes):
        try:
            body = parse(mp.CountTokensRequest, raw)
            chat = chat_request(body)
            async with self.models.use(body.model) as submissions:
                submissions.check_model(body.model)
                tokens = submissions.chat_tokens(chat)
        except APIError as exc:
            return anthropic_error(exc)
        return JSONResponse({"input_tokens": len(tokens)})

    @staticmethod
    def _finished(message: mp.Message, blocks: ContentBlocks, final: Delta) -> mp.Message:
        reason, sequence = stop_reason(final, blocks.called)
        usage = mp.Usage(input_tokens=final.prompt_tokens, output_tokens=final.completion_tokens,
                         cache_read_input_tokens=final.cached_tokens)
        return message.model_copy(update={"content": list(blocks.blocks), "stop_reason": reason,
                                          "stop_sequence": sequence, "usage": usage, "lockstep": rendered(final.report)})

    async def _stream(self, handles, message: mp.Message, blocks: ContentBlocks) -> AsyncIterator[str]:
        final = None
        try:
            started = False
            async for _, delta in choices.interleave(handles):
                if not started:  # the prompt's size is known from the first delta on
                    started = True
                    usage = mp.Usage(input_tokens=delta.prompt_tokens, output_tokens=0)
                    yield mp.event("message_start", message=message.model_copy(update={"usage": usage}).model_dump())
                    yield PING
                for event in blocks.add(delta.text):
                    yield event
                if delta.finish_reason is not None:
                    final = delta
            for event in blocks.finish():
                yield event
            done = self._finished(message, blocks, final)
            yield mp.event("message_delta", delta={"stop_reason": done.stop_reason, "stop_sequence": done.stop_sequence},
                           usage={"output_tokens": done.usage.output_tokens,
                                  "input_tokens": done.usage.input_tokens,
                                  "cache_read_input_tokens": done.usage.cache_read_input_tokens},
                           lockstep=done.lockstep)
            yield mp.event("message_stop")
        except GenerationError as exc:  # headers are sent: the failure is the stream's last event
            error = generation_error(exc)
            yield mp.event("error", error=mp.error_body(error.status, error.body.message)["error"])
        finally:
            choices.cancel_all(handles)  # the client went away (or we are done): free the slot


def _renamed(message: str) -> str:
    """Chat field names in a shared-path message -> the Messages API's."""
    for chat_name, name in PARAMS.items():
        message = message.replace(f"'{chat_name}'", f"'{name}'").replace(f"`{chat_name}`", f"`{name}`")
    return message
