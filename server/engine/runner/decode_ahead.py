"""Decoding ahead: the next decode pass built on the tokens of the one the device still runs.

A compiled decode pass of one row per request, every request choosing its token on the device
(`RequestState.decodes_ahead`: the row's argmax, or its position-keyed sampling), can be
followed at once by the next one, built on those tokens as arrays, as mlx-lm's generate loop
builds its next step: the host's building of pass N + 1 then overlaps the device's work on pass
N. The requests' caches look as if nothing ran ahead (their offsets are put back) until the
model runner's next `decode` finds the pass scheduled (some of the same requests, at the same
offsets, with the same inputs) and takes it over; otherwise it is dropped, and its KV rows,
past every offset, are written over later. The pass taken over is the one `decode` would have
built, under the same forms, so it has the same bits; a request that finished leaves its row
unused, which a deterministic row's bits do not depend on (the ragged proof).

The model runner (server/engine/runner/model_runner.py) decides when to build one and holds it; the
scheduler says when the same requests are expected next (`SchedulerOutput.decode_ahead`).
"""
from __future__ import annotations

import logging

import mlx.core as mx

from lockstep.kernels.batching.ragged import cache_position
from lockstep.kernels.invariance.layers import calls_in_blocks, native_forms

log = logging.getLogger(__name__)

# What becomes of a pass built ahead (the model runner counts each; /metrics shows them).
AHEAD_OUTCOMES = ("built", "taken", "dropped")


class AheadPass:
    """A decode pass built and submitted before the tokens of the pass before it reached the
    host: its requests (one row each), the cache offset each resumes at, each row's input
    token (an array), and its logits, argmax and sampling, in flight."""

    def __init__(self, states: list, canonical: bool, offsets: list[int], inputs: list[mx.array],
                 logits: mx.array, argmax: mx.array, sampled: list):
        self.states, self.canonical, self.offsets, self.inputs = states, canonical, offsets, inputs
        self.logits, self.argmax, self.sampled = logits, argmax, sampled

    def rows_for(self, members: list, canonical: bool) -> list[int] | None:
        """Each member's row in this pass, where `members` ((state, rows) of the pass now
        scheduled) are some of its requests, each at the offset and with the input it ran with
        (a request that finished meanwhile leaves its row unused); else None. A deterministic
        row needs a canonical pass; its bits do not depend on the rows beside it."""
        if canonical and not self.canonical:
            return None
        at = {id(state): i for i, state in enumerate(self.states)}
        rows = []
        for state, tokens in members:
            i = at.get(id(state))
            if i is None or cache_position(state.cache) != self.offsets[i] or tokens != self.inputs[i].tolist():
                return None
            rows.append(i)
        return rows


def advance(caches: list, rows: int) -> None:
    """Move every layer of each cache on by `rows` (back, for a negative count)."""
    for cache in caches:
        for layer in cache:
            layer.offset += rows


def following(members: list, spans: list) -> list | None:
    """The (member index, state, span) of every request whose next row may be built now,
    before this pass's tokens reach the host; None where a request would be in the next pass
    but its row cannot be built yet (drafts, logits processors), or where no request follows.
    A request at its last token has no next row."""
    rows = []
    for i, ((state, tokens), span) in enumerate(zip(members, spans)):
        if len(tokens) != 1 or not hasattr(state, "decodes_ahead"):
            return None
        if state.at_last_token:
            continue
        if not state.decodes_ahead():
            return None
        rows.append((i, state, span))
    return rows or None


def presample(members: list, logits: mx.array, spans: list, ahead: int = 0) -> list | None:
    """Each member's sampling of its rows, built lazily (`ahead`: for the row after its next
    one); None where building it fails (the pass then samples as without decoding ahead)."""
    try:
        return presample_pass(members, logits, spans, ahead)
    except Exception:
        return None


def presample_pass(members: list, logits: mx.array, spans: list, ahead: int = 0) -> list:
    """Each member's sampling of its rows, built lazily: one-row members whose sampling is of
    one group (every field but the seed the same) as one batch over their rows, each row's
    bits what it gets alone (their `row_sampling()`'s `batch`); the others each on its own
    (a batch's graph does not grow by a sampling per row). Rows that may join batches of at
    most w rows (`RowSampling.batch_rows`: deterministic rows, the widest proven width) go in
    blocks of the widths the proof compared (`RowSampling.blocks`: powers of two and w,
    largest first, in row order), so each block keeps its rows' bits and the pass builds a
    few samplings per group (13 rows under 8: 8, 4, 1), not one per row."""
    out = [None] * len(members)
    groups: dict = {}
    for i, ((state, _), span) in enumerate(zip(members, spans)):
        row_sampling = getattr(state, "row_sampling", None)
        row = row_sampling(ahead) if row_sampling is not None and span[1] - span[0] == 1 else None
        if row is None:
            out[i] = presample_rows(state, logits, span, ahead)
        else:
            groups.setdefault((row.group, row.batch_rows), []).append((i, row, span[0]))
    for group in groups.values():
        sizes = group[0][1].blocks(len(group))
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        for block in (group[start:start + size] for start, size in zip(starts, sizes)):
            if len(block) == 1:
                i, _, begin = block[0]
                out[i] = presample_rows(members[i][0], logits, (begin, begin + 1), ahead)
                continue
            rows = [row for _, row, _ in block]
            batch = rows[0].batch(logits[mx.array([begin for _, _, begin in block])], rows)
            for (i, _, _), pending in zip(block, batch):
                out[i] = pending
    return out


def presample_rows(state, logits: mx.array, span: tuple[int, int], ahead: int = 0):
    """`state.presample` of its rows `span` of the pass's `logits`, sliced only where it builds
    something (greedy rows build nothing, and a slice a row is a graph node a row)."""
    if not getattr(state, "presamples", True):
        return None
    begin, end = span
    return state.presample(logits[begin:end], ahead)


def submit_next(compiled, rows: list, canonical: bool, argmax: mx.array, sampled: list) -> AheadPass | None:
    """Submit this pass (its argmax and sampling), then build and submit the next one through
    `compiled` (CompiledPasses) for the `following` rows, on this pass's tokens; their caches'
    offsets are put back. None where the next pass cannot be built."""
    mx.async_eval(argmax, [x for s in sampled if s is not None for x in s.arrays])
    states = [state for _, state, _ in rows]
    inputs = [state.next_input(argmax[b:e], sampled[i]) for i, state, (b, e) in rows]
    offsets = [cache_position(state.cache) for state in states]
    tokens = mx.concatenate(inputs).astype(mx.int32)[None]
    try:
        with calls_in_blocks() if canonical else native_forms():
            logits = compiled.logits([(state.cache, [0]) for state in states], canonical=canonical, tokens=tokens)
    except Exception as exc:  # no room left in a request's range, or not traceable: no pass ahead
        log.debug("no pass decoded ahead: %s", exc)
        return None
    advance([state.cache for state in states], -1)
    argmax_next = mx.argmax(logits, axis=-1)
    sampled_next = presample([(state, [0]) for state in states], logits, [(j, j + 1) for j in range(len(states))],
                             ahead=1)
    if sampled_next is None:
        return None
    mx.async_eval(logits, argmax_next, [x for s in sampled_next if s is not None for x in s.arrays])
    return AheadPass(states, canonical, offsets, inputs, logits, argmax_next, sampled_next)
