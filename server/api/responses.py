"""POST /v1/responses: a Responses request runs as the chat request it translates to.

`chat_request` maps the request onto /v1/chat/completions' model (input items -> messages,
flat function tools -> chat tools, text.format -> response_format), so prompt building,
limits, grammars and tool-call parsing are the chat path's. `OutputItems` turns the output
text into Responses output items (one message, then the function calls) and the stream
events that announce them; the non-streamed answer is built by the same code, so the two
agree. A length-cut answer is `incomplete` (reason max_output_tokens) and its stream ends
in `response.incomplete`, as OpenAI's does; every other stream ends in `response.completed`.
"""
from __future__ import annotations

import re
import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from lockstep.server.api import choices
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api import responses_protocol as rp
from lockstep.server.api.chunk_json import EventTemplate
from lockstep.server.api.errors import APIError, generation_error, validation_text
from lockstep.server.api.tool_call_stream import ToolCallStream
from lockstep.server.api.tool_calls import ParsedCall, new_call_id
from lockstep.server.engine import GenerationError
from lockstep.server.engine.generate import Delta
from lockstep.server.engine.decoding.request_report import rendered

# Chat-request fields named in errors from the shared submission path -> the Responses field.
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text"}


# ----------------------------------------------------------------------------- request

def _chat_messages(body: rp.ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, rp.InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, rp.FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant":  # one turn, several calls
                previous.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
    return messages


def _rename_param(exc: APIError) -> None:
    """An error of the shared submission path, told in the Responses request's words: its
    `param`, and the field's name where the message names it (`max_completion_tokens is 9999,
    but ...`)."""
    chat_field = exc.body.param
    field = PARAMS.get(chat_field)
    if field is None:
        return
    exc.body.param = field
    if "_" in chat_field:  # a field name, never a word of the message's prose ("messages")
        exc.body.message = re.sub(rf"\b{chat_field}\b", field, exc.body.message)


def _response_format(text: rp.TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if not isinstance(fmt, rp.FormatJSONSchema):
        return fmt.model_dump() if fmt is not None else None
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_request(body: rp.ResponsesRequest) -> ChatCompletionRequest:
    """The /v1/chat/completions request that generates `body`'s answer."""
    tool_choice = body.tool_choice
    if isinstance(tool_choice, rp.ToolChoiceFunction):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    fields = {
        "model": body.model,
        "messages": _chat_messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in body.tools] if body.tools else None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "user": body.user,
        "seed": body.seed,
        "speculative": body.speculative,
        "num_draft_tokens": body.num_draft_tokens,
    }
    if "deterministic" in body.model_fields_set:  # unsent: the model name or the deployment decides
        fields["deterministic"] = body.deterministic
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        # ResponsesRequest is meant to refuse all such input first; if some slips through,
        # the error names the Responses field, never the chat model or pydantic's dump.
        error = exc.errors()[0]
        field = error["loc"][0] if error["loc"] else None
        param = PARAMS.get(field, field) if isinstance(field, str) else None
        if field == "messages" and body.instructions is not None and error["loc"][1:2] == (0,):
            param = "instructions"  # the system message `instructions` became
        message = validation_text(error)
        raise APIError(400, f"Invalid value for '{param}': {message}" if param else message,
                       param=param) from None


# ----------------------------------------------------------------------------- output

def _done(part: rp.OutputTextPart) -> rp.OutputTextPart:
    return part.model_copy()  # events carry snapshots: the live part keeps growing


class OutputItems:
    """A response's output items built from its text as it arrives, and their stream events.

    The message item opens when there is text to show (leading whitespace is held, so a
    model that only calls a tool gets no empty message); function calls are held until the
    end and follow the message, which is where a whole-text parse puts them too.
    """

    def __init__(self, calls: ToolCallStream | None):
        self.items: list[rp.OutputItem] = []
        self._calls_stream = calls
        self._calls: list[ParsedCall] = []
        self._message: rp.OutputMessage | None = None
        self._delta_json: EventTemplate | None = None  # the open message's text deltas
        self._held = ""

    def add(self, text: str) -> list[rp.StreamEvent]:
        if self._calls_stream is not None:
            text, calls = self._calls_stream.add(text)
            self._calls += calls
        return self._text(text)

    def finish(self, status: str) -> list[rp.StreamEvent]:
        """Closes the message and adds the calls; `status` is the message's (completed/incomplete)."""
        events = []
        if self._calls_stream is not None:
            rest, calls = self._calls_stream.finish()
            self._calls += calls
            events += self._text(rest)
        if self._message is None and not self._calls:  # an answer with no text is still a message
            held, self._held = self._held, ""
            events += self._open_message() + self._delta(held)
        if self._message is not None:
            events += self._close_message(status)
        for call in self._calls:
            events += self._function_call(call)
        return events

    def _text(self, text: str) -> list[rp.StreamEvent]:
        if self._message is not None:
            return self._delta(text)
        self._held += text
        if not self._held.strip():
            return []
        held, self._held = self._held, ""
        return self._open_message() + self._delta(held)

    def _open_message(self) -> list[rp.StreamEvent]:
        self._message = rp.OutputMessage(id=rp.new_id("msg"), content=[rp.OutputTextPart()])
        self.items.append(self._message)
        index = len(self.items) - 1
        self._delta_json = delta_template(self._message.id, index)
        return [rp.OutputItemEvent(type="response.output_item.added", output_index=index,
                                   item=self._message.model_copy(deep=True)),
                rp.ContentPartEvent(type="response.content_part.added", item_id=self._message.id,
                                    output_index=index, content_index=0, part=_done(self._message.content[0]))]

    def _delta(self, text: str) -> list[rp.StreamEvent]:
        if not text:
            return []
        self._message.content[0].text += text
        return [TextDelta(self._delta_json, text)]

    def _close_message(self, status: str) -> list[rp.StreamEvent]:
        message, self._message = self._message, None
        message.status = status
        index, part = self.items.index(message), message.content[0]
        return [rp.TextDoneEvent(item_id=message.id, output_index=index, content_index=0, text=part.text),
                rp.ContentPartEvent(type="response.content_part.done", item_id=message.id, output_index=index,
                                    content_index=0, part=_done(part)),
                rp.OutputItemEvent(type="response.output_item.done", output_index=index,
                                   item=message.model_copy(deep=True))]

    def _function_call(self, call: ParsedCall) -> list[rp.StreamEvent]:
        item = rp.FunctionCallItem(id=rp.new_id("fc"), call_id=new_call_id(), name=call.name,
                                   arguments=call.arguments)
        self.items.append(item)
        index = len(self.items) - 1
        added = item.model_copy(update={"arguments": "", "status": "in_progress"})
        return [rp.OutputItemEvent(type="response.output_item.added", output_index=index, item=added),
                rp.ArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=item.arguments),
                rp.ArgumentsDoneEvent(item_id=item.id, output_index=index, name=item.name,
                                      arguments=item.arguments),
                rp.OutputItemEvent(type="response.output_item.done", output_index=index, item=item)]


def delta_template(item_id: str, output_index: int) -> EventTemplate:
    """A message's text delta events as pydantic renders them, built once per message."""
    return EventTemplate(lambda sequence, text: rp.TextDeltaEvent(
        item_id=item_id, output_index=output_index, content_index=0, delta=text,
        sequence_number=sequence).model_dump_json(), number_field="sequence_number")


class TextDelta:
    """A response.output_text.delta event, its JSON filled into its message's template (a
    stream's most frequent event builds no pydantic object); numbered as the stream sends it."""

    type = "response.output_text.delta"

    def __init__(self, template: EventTemplate, text: str):
        self.template = template
        self.delta = text
        self.sequence_number = 0

    def model_dump_json(self) -> str:
        return self.template.fill(self.delta, self.sequence_number)


# ----------------------------------------------------------------------------- route

def _sse(event: rp.StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


class ResponsesRoute:
    """/v1/responses on top of the chat route's submission (`models.use(name)` gives the named
    model's `Submissions`, server/api/submission.py)."""

    def __init__(self, models):
        self.models = models

    async def create(self, body: rp.ResponsesRequest, receive=None):
        chat = chat_request(body)
        async with self.models.use(chat.model) as submissions:
            return await self._create(submissions, body, chat, receive)

    async def _create(self, submissions, body: rp.ResponsesRequest, chat: ChatCompletionRequest, receive):
        try:
            handles = await submissions.submit_chat(chat)
        except APIError as exc:
            _rename_param(exc)
            raise
        response = self._response(submissions, body, chat)
        items = OutputItems(submissions.tool_calls_stream(chat))
        if not body.stream:
            final = (await submissions.collect(handles, receive))[0]
            items.add(final.text)
            items.finish(self._status(final))
            return JSONResponse(self._finished(response, items, final).model_dump())
        return StreamingResponse(self._stream(handles, response, items), media_type="text/event-stream")

    @staticmethod
    def _response(submissions, body: rp.ResponsesRequest, chat: ChatCompletionRequest) -> rp.ResponseObject:
        """The in-progress response: the request's settings echoed, no output yet."""
        tool_choice = body.tool_choice or "auto"
        return rp.ResponseObject(
            id=rp.new_id("resp"), created_at=int(time.time()), status="in_progress", model=submissions.name,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            temperature=chat.temperature, top_p=chat.top_p, parallel_tool_calls=chat.parallel_tool_calls,
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            tools=[t.model_dump(by_alias=True) for t in body.tools or []],
            text={"format": body.text.format.model_dump(by_alias=True) if body.text and body.text.format
                  else {"type": "text"}, "verbosity": "medium"},
            metadata=body.metadata or {}, user=body.user)

    @staticmethod
    def _status(final: Delta) -> str:
        return "incomplete" if final.finish_reason == "length" else "completed"

    @staticmethod
    def _finished(response: rp.ResponseObject, items: OutputItems, final: Delta) -> rp.ResponseObject:
        status = ResponsesRoute._status(final)
        usage = rp.ResponseUsage(input_tokens=final.prompt_tokens, output_tokens=final.completion_tokens,
                                 total_tokens=final.prompt_tokens + final.completion_tokens,
                                 input_tokens_details=rp.InputTokensDetails(cached_tokens=final.cached_tokens))
        return response.model_copy(update={
            "status": status, "completed_at": int(time.time()), "output": list(items.items), "usage": usage,
            "incomplete_details": rp.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            "lockstep": rendered(final.report)})

    async def _events(self, handles, response: rp.ResponseObject, items: OutputItems) -> AsyncIterator[rp.StreamEvent]:
        yield rp.ResponseEvent(type="response.created", response=response)
        yield rp.ResponseEvent(type="response.in_progress", response=response)
        final = None
        async for _, delta in choices.interleave(handles):
            for event in items.add(delta.text):
                yield event
            if delta.finish_reason is not None:
                final = delta
        for event in items.finish(self._status(final)):
            yield event
        done = self._finished(response, items, final)
        yield rp.ResponseEvent(type=f"response.{done.status}", response=done)

    async def _stream(self, handles, response: rp.ResponseObject, items: OutputItems) -> AsyncIterator[str]:
        """SSE framing: `event: <type>` lines, numbered events, no [DONE] (as OpenAI sends them)."""
        sequence = 0
        try:
            async for event in self._events(handles, response, items):
                event.sequence_number, sequence = sequence, sequence + 1
                yield _sse(event)
        except GenerationError as exc:  # headers are sent: the failure is the stream's last event
            error = generation_error(exc).body
            failed = response.model_copy(update={
                "status": "failed", "output": list(items.items),
                "error": rp.ResponseError(code=error.code or "server_error", message=error.message)})
            yield _sse(rp.ResponseEvent(type="response.failed", response=failed, sequence_number=sequence))
        finally:
            choices.cancel_all(handles)  # the client went away (or we are done): free the slot
