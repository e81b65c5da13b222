"""The n choices of one request: each its own engine handle, read together.

Non-streamed, all are collected (`collect`); streamed, their Deltas are interleaved as they
arrive, tagged with the choice index (`interleave`). Either way every handle is cancelled
when the reader stops, so a client that leaves frees all its slots. A finished choice carries
its own `lockstep` object (`choice_lockstep`, `final_lockstep`), chat's and completions' alike.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from lockstep.server.api.response_bodies import CompletionTokensDetails, PromptTokensDetails, Usage
from lockstep.server.api.sampling_protocol import SamplingRequest
from lockstep.server.engine.decoding.request_report import rendered
from lockstep.server.engine.generate import Delta
from lockstep.server.engine.decoding.sampling import splitmix64

_INT64 = 1 << 63


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (n = 1 and choice 0 agree); choice i > 0 gets its own
    stream (seed, i), an int64 like every seed."""
    if index == 0:
        return seed
    mixed = splitmix64(splitmix64(seed & ((1 << 64) - 1)) ^ index)
    return mixed - (1 << 64) if mixed >= _INT64 else mixed


def merge(deltas: list[Delta]) -> Delta:
    """One choice's Deltas as one."""
    last = deltas[-1]
    return Delta(
        text="".join(d.text for d in deltas),
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        logprobs=[lp for d in deltas for lp in d.logprobs],
        text_offsets=[o for d in deltas for o in d.text_offsets],
        finish_reason=last.finish_reason,
        report=last.report,
        stop_sequence=last.stop_sequence,
        token_ids=last.token_ids,
        cached_tokens=last.cached_tokens,
    )


def prediction_counts(final: Delta) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens of one choice (RequestReport.prediction_tokens)."""
    return final.report.prediction_tokens if final.report is not None else (0, 0)


def usage(finals: list[Delta]) -> Usage:
    """The prompt counts once; completion tokens and prediction tokens add up over the choices."""
    prompt = finals[0].prompt_tokens
    completion = sum(d.completion_tokens for d in finals)
    counts = [prediction_counts(d) for d in finals]
    details = CompletionTokensDetails(accepted_prediction_tokens=sum(a for a, _ in counts),
                                      rejected_prediction_tokens=sum(r for _, r in counts))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=finals[0].cached_tokens),
                 completion_tokens_details=details)


def choice_lockstep(d: Delta, body: SamplingRequest) -> dict | None:
    """A finished choice's own `lockstep` object: its receipt, and its token ids when asked."""
    if d.report is None:
        return None
    info = {"receipt": d.report.receipt}
    if body.return_token_ids:
        info["token_ids"] = list(d.token_ids or ())
    return info


def final_lockstep(d: Delta, body: SamplingRequest) -> dict | None:
    """A stream's `lockstep` object on a choice's final chunk (its own report and receipt)."""
    if d.report is None or not body.return_token_ids:
        return rendered(d.report)
    return {**d.report.render(), "token_ids": list(d.token_ids or ())}


def cancel_all(handles) -> None:
    for handle in handles:
        handle.cancel()


async def collect(handles) -> list[Delta]:
    """Each choice's whole output, in choice order."""
    async def one(handle) -> Delta:
        return merge([delta async for delta in handle])

    try:
        return list(await asyncio.gather(*(one(h) for h in handles)))
    finally:
        cancel_all(handles)  # frees the slots if this handler is cancelled mid-way


class _Ended:
    pass


async def interleave(handles) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, Delta) in arrival order until every choice has finished."""
    if len(handles) == 1:
        async for delta in handles[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle) -> None:
        try:
            async for delta in handle:
                await queue.put((index, delta))
            await queue.put((index, _Ended()))
        except Exception as exc:  # e.g. GenerationError: re-raised to the reader
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        ended = 0
        while ended < len(handles):
            index, item = await queue.get()
            if isinstance(item, _Ended):
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        cancel_all(handles)
