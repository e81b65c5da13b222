"""POST /v1/completions' answer: each choice's text, finish reason and logprobs (with their text
offsets), as one `text_completion` or as its stream of `text_completion` chunks. The request
is submitted by the model's `Submissions` (submission.py).

Streamed, a chunk of text alone (most of a stream's) is rendered from the choice's template
(chunk_json.py); a choice's final chunk carries its finish reason and `lockstep` object.
"""
from __future__ import annotations

from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from lockstep.server.api import choices, sse
from lockstep.server.api.chunk_json import ChunkTemplate
from lockstep.server.api.completions_protocol import CompletionRequest
from lockstep.server.api.response_bodies import CompletionChoice, CompletionLogprobs, TextCompletion, new_id
from lockstep.server.api.submission import Submissions
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.generate import Delta


def _logprobs(delta: Delta) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[lp.token for lp in delta.logprobs],
        token_logprobs=[lp.logprob for lp in delta.logprobs],
        top_logprobs=[dict(lp.top) for lp in delta.logprobs],
        text_offset=list(delta.text_offsets),
    )


async def text_completion(submissions: Submissions, body: CompletionRequest, receive=None):
    """The answer to `body`, submitted to `submissions`' model: JSON, or an SSE stream when asked."""
    handles = await submissions.submit_completion(body)
    common = {"id": new_id("cmpl"), "model": submissions.name, "system_fingerprint": submissions.fingerprint}

    def choice(i: int, d: Delta) -> CompletionChoice:
        logprobs = _logprobs(d) if body.logprobs is not None else None
        return CompletionChoice(index=i, text=d.text, finish_reason=d.finish_reason, logprobs=logprobs,
                                lockstep=choices.choice_lockstep(d, body) if not body.stream else None)

    if not body.stream:
        finals = await submissions.collect(handles, receive)
        return JSONResponse(TextCompletion(
            **common, choices=[choice(i, d) for i, d in enumerate(finals)],
            usage=choices.usage(finals), lockstep=rendered(finals[0].report)).model_dump())

    async def chunks() -> AsyncIterator[TextCompletion | str]:
        finals: list[Delta] = []
        templates: dict[int, ChunkTemplate] = {}  # per choice
        async for i, d in choices.interleave(handles):
            if d.finish_reason is None and body.logprobs is None:
                # text alone, most of a stream's chunks: their JSON from the choice's template
                if i not in templates:
                    templates[i] = ChunkTemplate(lambda created, text, i=i: TextCompletion(
                        **common, created=created, choices=[CompletionChoice(index=i, text=text)]))
                yield templates[i].render(d.text)
                continue
            yield TextCompletion(**common, choices=[choice(i, d)], lockstep=choices.final_lockstep(d, body))
            if d.finish_reason is not None:
                finals.append(d)
        if body.include_usage():
            yield TextCompletion(**common, choices=[], usage=choices.usage(finals))

    return StreamingResponse(sse.stream(handles, chunks(), gather=True), media_type="text/event-stream")
