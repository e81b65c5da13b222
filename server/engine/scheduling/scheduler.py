"""The scheduler: which requests run, and what each engine step runs for them.

It never runs the model (server/engine/runner/model_runner.py does). Each step it describes work
as a `SchedulerOutput` (server/engine/runner/step_data.py) and updates its requests from the
runner's `ModelRunnerOutput`:
1. admission: waiting requests take free slots (`max_active`) in FIFO order while their KV
   fits the budget (server/engine/scheduling/kv_budget.py). The choices of one request (n > 1) hold
   at most `active_per_request` slots at once, and no choice of any n > 1 request takes the
   last free slot: its other choices wait, and other requests' may go ahead of them, so a
   request with n = 1 finds a slot whatever mix of n > 1 requests runs;
2. prompt chunks of prefilling requests, in turn, up to one chunk's worth of tokens
   (`--prefill-chunk`; a draft model's prompt is prefilled the same way, its chunks also
   bounded by their measured cost, request_state.py), so a long prompt
   is interleaved with decoding and never stalls the others for its whole length, while
   many short prompts start together. On the CPU a plain prompt's chunks are smaller
   (deployment.py `plain_prefill_chunk`) and a long one skips every other step while
   others decode;
3. every decoding request's rows (1, or at most k + 1 when speculating: its policy's k within
   the room the pass has left), grouped into passes by the determinism rule
   (server/engine/scheduling/passes.py), each pass one forward over all its requests' rows;
   the model runner drafts, runs and samples them, and `update_from_output` advances each
   request by the tokens the runner chose.
Until the kernel audit has covered every call width (`audited`, kernels/audit/widths.py: the
narrow widths are audited after serving starts), no call of an unaudited width runs: prompt
chunks are cut to audited widths and run alone, every request brings one decode row, and a
pass of an unaudited width is split into passes of audited widths.
All of it runs on the engine's worker thread (server/engine/engine.py).
"""
from __future__ import annotations

import logging
import time

from lockstep.kernels.audit.widths import AuditedRows
from lockstep.kernels.invariance.prefill import free_splits
from lockstep.server.engine.guarantee.decode_plan import Determinism
from lockstep.server.engine.guarantee.deployment import sampling_only_change
from lockstep.server.engine.scheduling.errors import GenerationError
from lockstep.server.engine.scheduling.handle import RequestHandle
from lockstep.server.engine.scheduling.kv_budget import KVBudget, reservation
from lockstep.server.engine.scheduling.passes import Demand, compose_passes
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from lockstep.server.engine.decoding.request_state import RequestState
from lockstep.server.engine.runner.step_data import (DecodeRows, ModelRunnerOutput, PrefillResult, ScheduledPass,
                                              SchedulerOutput)

log = logging.getLogger(__name__)


class Slot:
    """An admitted request: its handle, its state and the KV it reserved."""

    def __init__(self, handle: RequestHandle, state: RequestState, reserved: int):
        self.handle = handle
        self.state = state
        self.reserved = reserved
        self.yielded = 0  # steps its next canonical prompt chunk has left to decoding requests


def request_of(handle: RequestHandle) -> RequestHandle:
    """The handle standing for the whole request (its first choice's)."""
    return handle.leader or handle


class _DraftRoom:
    """Rows each decoding request may bring this step, asked in turn order: one row per
    request is reserved, and drafts get only what is left of a pass (the guaranteed rows for
    deterministic requests, max_batch_rows for others), so a full batch stops drafting.
    Drafts never change tokens (sample and compare), only how many passes a request takes."""

    def __init__(self, decoding: list[RequestState], shared_rows: int, call_rows: int, max_batch_rows: int):
        self.capacity = {Determinism.SHARED: shared_rows, Determinism.ALONE: call_rows, Determinism.NONE: max_batch_rows}
        self.pending = {kind: sum(s.determinism == kind for s in decoding) for kind in self.capacity}
        self.claimed = dict.fromkeys(self.capacity, 0)

    def take(self, state: RequestState) -> int:
        kind = state.determinism
        if kind == Determinism.ALONE:  # a pass of its own: the whole width is this request's
            return max(1, self.capacity[kind])
        self.pending[kind] = max(0, self.pending[kind] - 1)
        return max(1, self.capacity[kind] - self.claimed[kind] - self.pending[kind])

    def claim(self, state: RequestState, rows: int) -> None:
        self.claimed[state.determinism] += rows


class Scheduler:
    """Admission and step composition for one engine. `runner` gives KV caches (its pool)
    and says whether requests may share passes."""

    draft_room: bool = True  # a full pass stops drafting (_DraftRoom)

    def __init__(self, loaded, runner, *, deployment, max_active: int, active_per_request: int,
                 max_batch_rows: int, kv_budget: KVBudget, prefix_cache: PrefixCache | None = None,
                 audited: AuditedRows | None = None):
        self.loaded = loaded
        self.runner = runner
        self.deployment = deployment
        self.max_active = max_active
        self.active_per_request = active_per_request
        self.max_batch_rows = max_batch_rows
        self.kv_budget = kv_budget
        self.prefix_cache = prefix_cache
        self.audited = audited or AuditedRows()  # the call widths the kernel audit has covered
        self.waiting: list[RequestHandle] = []
        self.active: list[Slot] = []
        self.turn = 0  # rotates which request goes first
        self.cancelled = 0  # requests (not choices) dropped because their client went away
        self._counted: set[int] = set()  # requests already in `cancelled`
        self.on_admit = lambda waited: None
        self.on_fail = self._log_failure

    def set_deployment(self, deployment) -> None:
        """Admit under `deployment` from now on. A wider batched-sampling proof reaches the
        requests admitted before it too: their rows keep their bits in its blocks (what it
        proved), and fewer samplings run a pass."""
        before, self.deployment = self.deployment, deployment
        if sampling_only_change(before, deployment):
            for slot in self.active:
                slot.state.prove_sampling(deployment.guarantee.sampling_rows)

    @property
    def shared_rows(self) -> int:
        """Rows a pass holding deterministic rows of several requests may have: the widest
        width the ragged proof covered (L bounds one kernel call, not a pass)."""
        return min(self.max_batch_rows, max(self.deployment.guarantee.pass_rows, self.call_rows))

    @property
    def call_rows(self) -> int:
        """Rows one kernel call may hold with the guarantee: L where it is proven, else 0."""
        guarantee = self.deployment.guarantee
        return guarantee.call_rows if guarantee.guaranteed else 0

    # ----------------------------------------------------------------------- queue

    def reservation(self, handle: RequestHandle) -> int:
        plan = handle.plan
        return reservation(len(handle.request.prompt_tokens), handle.request.max_tokens,
                           plan.num_draft_tokens if plan else 0)

    def kv_needed_at_once(self, handles: list[RequestHandle]) -> int:
        """KV the choices of one request hold at most at once (`active_per_request` of them)."""
        sizes = sorted((self.reservation(h) for h in handles), reverse=True)
        return sum(sizes[:self.active_per_request])

    def waiting_requests(self) -> int:
        """Requests none of whose choices has started (a request whose other choices run is
        running, not waiting)."""
        running = {id(request_of(slot.handle)) for slot in self.active}
        return len({id(request_of(h)) for h in self.waiting} - running)

    def note_cancelled(self, handle: RequestHandle) -> None:
        """Count a request whose client went away, once however many choices it has."""
        if not handle.client_cancelled:
            return
        key = id(request_of(handle))
        if key not in self._counted:
            self._counted.add(key)
            self.cancelled += 1

    # ------------------------------------------------------------------- admission

    def _grouped(self) -> set[int]:
        """Requests with n > 1 among the waiting and running ones (by their first choice)."""
        handles = self.waiting + [slot.handle for slot in self.active]
        return {id(handle.leader) for handle in handles if handle.leader is not None}

    def _room_for_grouped(self) -> bool:
        """Whether a choice of an n > 1 request may start now: not into the last free slot,
        which is kept for requests of one choice (a server of one slot keeps none)."""
        return not self.active or self.max_active - len(self.active) >= 2

    def admit(self) -> None:
        """Move waiting requests into free slots (caller holds the engine's lock)."""
        if not self.waiting:
            return  # every step asks: nothing to count then
        held: dict[int, int] = {}
        for slot in self.active:
            key = id(request_of(slot.handle))
            held[key] = held.get(key, 0) + 1
        grouped = self._grouped()
        i = 0
        while i < len(self.waiting) and len(self.active) < self.max_active:
            handle = self.waiting[i]
            if handle.cancelled:
                self.waiting.pop(i)
                self.note_cancelled(handle)
                continue
            key = id(request_of(handle))
            if held.get(key, 0) >= self.active_per_request or (key in grouped and not self._room_for_grouped()):
                i += 1  # its request, or n > 1 work together, holds its share: later requests may go first
                continue
            needed = self.reservation(handle)
            if not self.kv_budget.try_reserve(needed):
                break  # FIFO: it goes first once enough KV is released
            pool = self.runner.kv_pool
            if pool is not None and not pool.can_allocate(needed):  # within budget; free slots split up
                self.kv_budget.release(needed)
                break
            self.waiting.pop(i)
            self.on_admit(time.monotonic() - handle.submitted_at)
            try:
                slot = self._start(handle, needed)
            except Exception as exc:
                self.kv_budget.release(needed)
                self.on_fail(handle, exc)
                continue
            self.active.append(slot)
            held[key] = held.get(key, 0) + 1

    def _prompt_source(self, handle: RequestHandle) -> RequestState | None:
        """For a choice after the first (n > 1): a running choice of the same request whose
        prompt KV it copies (the first choice, or, once that has finished, any other)."""
        if handle.leader is None:
            return None
        siblings = [handle.leader.state] + [slot.state for slot in self.active
                                            if request_of(slot.handle) is handle.leader]
        return next((s for s in siblings if s is not None and not s.closed), None)

    def _start(self, handle: RequestHandle, reserved: int) -> Slot:
        leader = self._prompt_source(handle)
        cache = self.runner.new_cache(reserved) if self.runner.kv_pool is not None else None
        cancelled = lambda: handle.cancelled  # noqa: E731
        try:
            handle.state = RequestState(self.loaded, handle.request, plan=handle.plan,
                                        deployment=self.deployment, prefix_cache=self.prefix_cache,
                                        cancelled=cancelled, prefill_from=leader, cache=cache)
        except Exception:
            self.runner.release(cache)
            raise
        return Slot(handle, handle.state, reserved)

    def remove(self, slot: Slot) -> None:
        if slot in self.active:
            self.active.remove(slot)
        self.kv_budget.release(slot.reserved)
        slot.state.closed = True  # a follower of this request prefills on its own now
        self.runner.release(slot.state.cache)

    def drop_cancelled(self) -> None:
        for slot in [s for s in self.active if s.handle.cancelled]:
            self.note_cancelled(slot.handle)
            self.remove(slot)

    def _in_turn(self) -> list[Slot]:
        """Active requests, starting with a different one each step."""
        n = len(self.active)
        if n == 0:
            return []
        start = self.turn % n
        return self.active[start:] + self.active[:start]

    def _fail(self, slot: Slot, exc: Exception) -> None:
        self.on_fail(slot.handle, exc)
        self.remove(slot)

    @staticmethod
    def _log_failure(handle: RequestHandle, exc: Exception) -> None:
        log.error("generation failed", exc_info=exc)
        handle.post(GenerationError(f"generation failed: {type(exc).__name__}: {exc}"))

    # ----------------------------------------------------------------- prompt chunks

    def schedule_prefill(self) -> SchedulerOutput:
        """Prompt chunks, up to one chunk's worth of tokens this step: many short prompts
        start together, a long one (target or draft) still goes a chunk at a time. Target
        chunks of requests with no determinism to keep share one pass; others run alone."""
        chunk = self.deployment.prefill_chunk
        budget = chunk
        output = SchedulerOutput()
        gated = not self.audited.complete
        someone_decodes = self._someone_decodes()
        yield_to_decode = someone_decodes and self.deployment.plain_prefill_chunk > 0 and self.turn % 2 == 1
        for slot in self._in_turn():
            if budget <= 0:
                break
            state = slot.state
            if not state.prefilling or slot.handle.cancelled:
                continue
            if yield_to_decode and state.long_plain_prompt:
                continue  # this step is the decoding requests'
            if someone_decodes and slot.yielded < state.steps_to_yield(self.deployment.plain_prefill_chunk):
                slot.yielded += 1  # a wide canonical chunk: decoding requests' steps come first
                continue
            if gated:  # the chunk cut to an audited width (its rest comes in later steps)
                state.chunk_limit = None
                state.chunk_limit = self.audited.widest(state.next_chunk_tokens())
            elif state.chunk_limit is not None:
                state.chunk_limit = None
            tokens = state.next_chunk_tokens()
            if tokens > budget and budget < chunk:
                continue  # too big for what is left of this step; its turn to go first comes
            slot.yielded = 0
            if tokens and state.shares_prefill and self.runner.batched and not gated:
                output.prefill_shared.append(slot)
            else:
                output.prefill_alone.append(slot)
            budget -= tokens
        if len(output.prefill_shared) == 1:
            output.prefill_alone += output.prefill_shared
            output.prefill_shared = []
        return output

    def _someone_decodes(self) -> bool:
        """Whether some request decodes, so prompts yield steps to it: a long plain prompt
        every other step, where plain chunks are small (deployment.plain_prefill_chunk), so a
        short request beside a long prompt waits one small chunk per two of its tokens; a
        wider canonical chunk as many steps as the plain chunks it spans
        (`RequestState.steps_to_yield`). Functions of the step count and the requests only:
        replicas stay in step."""
        return any(not s.state.prefilling and not s.handle.cancelled for s in self.active)

    # ------------------------------------------------------------------ decode passes

    def schedule_decode(self) -> SchedulerOutput:
        """Every decoding request's rows, grouped into passes: its last token and the drafts
        its policy allows within the room the pass has left (the runner drafts them; a drafter
        may propose fewer, so a pass is composed on the rows at most)."""
        decoding = [s for s in self._in_turn() if not s.state.prefilling and not s.handle.cancelled]
        gated = not self.audited.complete
        room = (_DraftRoom([s.state for s in decoding], self.shared_rows, self.call_rows, self.max_batch_rows)
                if self.runner.batched and self.draft_room and not gated else None)
        demands = []
        for slot in decoding:
            try:
                k = slot.state.draft_length(1 if gated else room.take(slot.state) if room else None)
            except Exception as exc:
                self._fail(slot, exc)
                continue
            member = DecodeRows(slot, slot.state.last_token, k)
            if room:
                room.claim(slot.state, member.rows)
            demands.append(Demand(member, member.rows, slot.state.determinism))
        if self.runner.batched:
            groups = compose_passes(demands, self.shared_rows, self.max_batch_rows)
        else:
            groups = [[d] for d in demands]
        if gated:
            groups = [part for group in groups for part in self._audited_passes(group)]
        # The same requests decode in one pass next step unless one joins: nothing prefills, and no
        # waiting request gets the room of one finishing at its last token now.
        steady = (len(groups) == 1 and not any(s.state.prefilling for s in self.active)
                  and not (self.waiting and any(getattr(s.state, "at_last_token", False) for s in decoding)))
        return SchedulerOutput(passes=[ScheduledPass([d.owner for d in group]) for group in groups],
                               decode_ahead=steady)

    def _audited_passes(self, group: list[Demand]) -> list[list[Demand]]:
        """A pass as passes of audited widths (while the audit is partial each demand is one row)."""
        parts, start = [], 0
        for width in self.audited.split(sum(d.rows for d in group)):
            parts.append(group[start:start + width])
            start += width
        return [p for p in parts if p]

    # ----------------------------------------------------------------------- update

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list:
        """Requests advanced by what ran: (handle, deltas) to post, finished and failed
        requests removed."""
        for slot, done in zip(output.prefill_alone, result.prefill_alone):
            if isinstance(done, Exception):
                self._fail(slot, done)
            elif not done.follow:
                slot.state.chunk_written(done.tokens, alone=True, model=done.model)
        if output.prefill_shared:
            if isinstance(result.prefill_shared, Exception):
                for slot in output.prefill_shared:
                    self._fail(slot, result.prefill_shared)
            else:
                # A chunk as wide as the deployment proved keeps its KV in a shared pass
                # (guarantee.py): as good as alone for the prefix cache.
                rows = self.deployment.guarantee.shared_prefill_rows
                for slot, tokens in zip(output.prefill_shared, result.prefill_shared):
                    slot.state.chunk_written(tokens, alone=0 < rows <= tokens)
        posts = []
        for scheduled, done in zip(output.passes, result.passes):
            if isinstance(done, Exception):
                for member in scheduled.members:
                    self._fail(member.slot, done)
                continue
            for member, sampled in zip(scheduled.members, done.members):
                slot = member.slot
                if sampled is None:
                    continue  # its client left while the pass was drafted: dropped next step
                if isinstance(sampled, Exception):
                    self._fail(slot, sampled)
                    continue
                try:
                    deltas = slot.state.advance(sampled)
                except Exception as exc:
                    self._fail(slot, exc)
                    continue
                posts.append((slot.handle, deltas))
                if slot.state.finished:
                    self.remove(slot)
        return posts

    def describe(self) -> dict:
        guarantee = self.deployment.guarantee
        return {"max_active": self.max_active, "max_active_per_request": self.active_per_request,
                "max_batch_rows": self.max_batch_rows,
                "deterministic_pass_rows": self.shared_rows if guarantee.shared_passes else self.call_rows,
                "deterministic_call_rows": self.call_rows,
                # deterministic rows of one sampling group sampled as one batch of at most this many
                "deterministic_sampling_rows": guarantee.sampling_rows if guarantee.shared_passes else 0,
                "max_kv_tokens": self.kv_budget.capacity,
                "deterministic_rows_shared": guarantee.shared_passes and self.runner.batched,
                # deterministic prompt chunks of at least this many rows share prefill passes
                "deterministic_prefill_rows": guarantee.shared_prefill_rows if self.runner.batched else 0,
                # a deterministic prompt may be cut anywhere into chunks of at least this many rows
                # (0: its chunks end on the grid, and a prefix-cache hit resumes at a grid point)
                "deterministic_split_rows": free_splits(guarantee.prefill_split_rows, self.deployment.prefill_chunk),
                **self.audited.describe(),
                **self.runner.describe()}


__all__ = ["PrefillResult", "Scheduler", "Slot"]
