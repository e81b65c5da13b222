"""POST /v1/chat/completions' answer: each choice's message (content, tool calls or a legacy
`function_call`), finish reason and logprobs, as one `chat.completion` or as its stream of
`chat.completion.chunk`s. The request is submitted by the model's `Submissions` (submission.py).

Streamed, a choice's role comes in its first chunk, tool calls as `tool_calls` deltas once
whole, and a chunk of text alone (most of a stream's) is rendered from the choice's template
(chunk_json.py); its final chunk carries the finish reason and its `lockstep` object.
"""
from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from lockstep.server.api import choices, sse
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.chunk_json import ChunkTemplate
from lockstep.server.api.response_bodies import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                 ChatCompletionChunk, ChatDelta, ChatLogprobs, ChatTokenLogprob,
                                                 ResponseFunctionCall, ResponseToolCall, ToolCallDelta, TopLogprob,
                                                 new_id)
from lockstep.server.api.submission import Submissions
from lockstep.server.api.tool_calls import ParsedCall, new_call_id
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.generate import Delta


def _logprobs(delta: Delta) -> ChatLogprobs:
    def top(token: str, logprob: float) -> TopLogprob:
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
                top_logprobs=[top(t, v) for t, v in lp.top],
            )
            for lp in delta.logprobs
        ]
    )


def _response_calls(calls: list[ParsedCall]) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=new_call_id(), function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def _finish_reason(reason: str | None, called: bool, legacy: bool = False) -> str | None:
    if called and reason == "stop":
        return "function_call" if legacy else "tool_calls"
    return reason


def _choice(submissions: Submissions, index: int, d: Delta, body: ChatCompletionRequest) -> ChatChoice:
    stream = submissions.tool_calls_stream(body)
    content, calls = (d.text, []) if stream is None else stream.split(d.text)
    legacy = body.legacy_functions()  # deprecated functions: the call as message.function_call
    cut_off = stream is not None and stream.cut_off
    message = AssistantMessage(
        content=(content or None) if calls or cut_off else content,  # null, not "", beside a call
        tool_calls=None if legacy else _response_calls(calls) or None,
        function_call=ResponseFunctionCall(name=calls[0].name, arguments=calls[0].arguments)
        if legacy and calls else None)
    return ChatChoice(index=index, message=message,
                      finish_reason=_finish_reason(d.finish_reason, bool(calls), legacy),
                      logprobs=_logprobs(d) if body.logprobs else None,
                      lockstep=choices.choice_lockstep(d, body))


async def chat_completion(submissions: Submissions, body: ChatCompletionRequest, receive=None):
    """The answer to `body`, submitted to `submissions`' model: JSON, or an SSE stream when asked."""
    handles = await submissions.submit_chat(body)
    common = {"id": new_id("chatcmpl"), "model": submissions.name, "system_fingerprint": submissions.fingerprint}
    if body.service_tier is not None:  # one tier here, named as OpenAI names its standard one
        common["service_tier"] = "default"
    legacy = body.legacy_functions()

    if not body.stream:
        finals = await submissions.collect(handles, receive)
        return JSONResponse(ChatCompletion(
            **common, choices=[_choice(submissions, i, d, body) for i, d in enumerate(finals)],
            usage=choices.usage(finals), lockstep=rendered(finals[0].report)).model_dump())

    async def chunks() -> AsyncIterator[ChatCompletionChunk | str]:
        role_due = [True] * len(handles)  # the role is sent once per choice, in its first chunk
        calls = [submissions.tool_calls_stream(body) for _ in handles]
        sent = [0] * len(handles)  # tool calls sent per choice
        templates: dict[int, ChunkTemplate] = {}  # per choice
        finals: list[Delta] = []
        async for i, d in choices.interleave(handles):
            text, new_calls = d.text, []
            if calls[i] is not None:
                text, new_calls = calls[i].add(d.text)
                if d.finish_reason is not None:
                    rest, more = calls[i].finish()
                    text, new_calls = text + rest, new_calls + more
            if text and not (d.logprobs or role_due[i] or new_calls or body.logprobs):
                # a chunk of text alone, most of a stream's: its JSON from the choice's template
                if i not in templates:
                    templates[i] = ChunkTemplate(lambda created, content, i=i: ChatCompletionChunk(
                        **common, created=created,
                        choices=[ChatChunkChoice(index=i, delta=ChatDelta(content=content))]))
                yield templates[i].render(text)
            elif text or d.logprobs or role_due[i] or new_calls:
                tool_deltas = [ToolCallDelta(index=sent[i] + k, id=c.id, function=c.function)
                               for k, c in enumerate(_response_calls(new_calls))] or None
                sent[i] += len(new_calls)
                function_call = None
                if legacy and tool_deltas:  # at most one call (parallel_tool_calls is off)
                    function_call, tool_deltas = tool_deltas[0].function, None
                delta = ChatDelta(role="assistant" if role_due[i] else None,
                                  content=text if text or not (tool_deltas or function_call) else None,
                                  tool_calls=tool_deltas, function_call=function_call)
                logprobs = _logprobs(d) if body.logprobs else None
                yield ChatCompletionChunk(**common, choices=[ChatChunkChoice(index=i, delta=delta, logprobs=logprobs)])
                role_due[i] = False
            if d.finish_reason is not None:
                finish = ChatChunkChoice(index=i, delta=ChatDelta(),
                                         finish_reason=_finish_reason(d.finish_reason, sent[i] > 0, legacy))
                yield ChatCompletionChunk(**common, choices=[finish], lockstep=choices.final_lockstep(d, body))
                finals.append(d)
        if body.include_usage():
            yield ChatCompletionChunk(**common, choices=[], usage=choices.usage(finals))

    # tool calls and gpt-oss channels hold text back: a delta may then make no chunk
    gather = submissions.tool_calls_stream(body) is None
    return StreamingResponse(sse.stream(handles, chunks(), gather), media_type="text/event-stream")
