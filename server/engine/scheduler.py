"""The engine: owns the model on one worker thread and batches requests into forward passes.

All MLX work happens on the worker thread, never on the asyncio loop. Requests are
admitted in FIFO order while there is a free slot (`max_active`) and room in the KV budget
(server/engine/kv_budget.py). Each iteration of the worker then
1. runs prompt chunks of prefilling requests, in turn, up to one chunk's worth of tokens
   (`--prefill-chunk`), so a long prompt is interleaved with decoding and never stalls the
   others for its whole length, while many short prompts start together;
2. asks every decoding request for its rows (1, or k + 1 when speculating), groups them
   into passes by the determinism rule (server/engine/passes.py) and runs each pass as one
   forward over all its requests' rows, each attending its own KV cache
   (kernels/batching/ragged.py); every request then turns its rows into tokens.
Each request's output comes back to asyncio through its `RequestHandle`.

A request whose plan is exclusive (deterministic, but the guarantee is not proven) runs
alone. `generate_fn` replaces the batched path with one generator per request, stepped in
turn (test doubles script the engine with it).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Iterator

from lockstep.server.engine.decoding import DecodePlan, Deployment
from lockstep.server.engine.forward_step import decode_logits, presample_together, shared_prefill
from lockstep.server.engine.kv_budget import KVBudget, reservation
from lockstep.server.engine.passes import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS, Demand, compose_passes
from lockstep.server.engine.prefix_cache import PrefixCache
from lockstep.server.engine.handle import (GenerationError, QueueFull, RequestHandle, ShuttingDown, post_all,
                                  TooLargeForMemory)
from lockstep.server.engine.request_state import GenerationRequest, RequestState

log = logging.getLogger(__name__)

# Initial KV pool size per `max_active` slot (the pool doubles when a request needs more).
POOL_TOKENS_PER_SLOT = 1024



class _Active:
    """An admitted request: its handle, its work (a RequestState or a generator) and its KV."""

    def __init__(self, handle: RequestHandle, work, reserved: int):
        self.handle = handle
        self.work = work
        self.reserved = reserved


class _DraftRoom:
    """Rows each decoding request may bring this iteration, asked in turn order: one row per
    request is reserved, and drafts get only what is left of a pass (L rows for deterministic
    requests, max_batch_rows for others), so a full batch stops drafting. Drafts never change
    tokens (sample and compare), only how many passes a request takes."""

    def __init__(self, decoding: list, limit: int, max_batch_rows: int):
        self.pending = {kind: sum(s.deterministic == kind for s in decoding) for kind in (True, False)}
        self.claimed = {True: 0, False: 0}
        self.capacity = {True: limit, False: max_batch_rows}

    def take(self, state) -> int:
        kind = state.deterministic
        self.pending[kind] = max(0, self.pending[kind] - 1)
        return max(1, self.capacity[kind] - self.claimed[kind] - self.pending[kind])


class EngineObserver:
    """What the engine reports as it runs (metrics implement it); every method is optional."""

    def on_pass(self, rows: int, requests: int) -> None: ...

    def on_admit(self, waited_seconds: float) -> None: ...


class Engine:
    max_waiting: int | None = None  # waiting requests before submit() refuses; None = unbounded
    draft_room: bool = True  # a full pass stops drafting (`_draft_room`)

    def __init__(self, loaded, max_active: int = DEFAULT_MAX_ACTIVE,
                 generate_fn: Callable[..., Iterator] | None = None,
                 deployment: Deployment | None = None, prefix_cache: PrefixCache | None = None,
                 max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS, max_kv_tokens: int | None = None):
        if max_active < 1 or max_batch_rows < 1:
            raise ValueError("max_active and max_batch_rows must be >= 1")
        self.loaded = loaded
        self.max_active = max_active
        self.max_batch_rows = max_batch_rows
        self.deployment = deployment or Deployment()
        self.prefix_cache = prefix_cache
        self.kv_budget = KVBudget(max_kv_tokens)
        self.observers: list[EngineObserver] = []
        self._generate = generate_fn
        self.ragged_problem = self._prepare_ragged()
        self.kv_pool = self._make_pool(max_kv_tokens)
        self.ragged_proof = self._prove_ragged()
        self._waiting: list[RequestHandle] = []
        self._active: list[_Active] = []
        self._turn = 0  # rotates which request goes first
        self._wake = threading.Condition()
        self._stopping = False
        self._cancelled = 0  # requests dropped because their client went away
        self._thread: threading.Thread | None = None

    def _prepare_ragged(self) -> str | None:
        """Patch the model for ragged passes; why not, when it cannot (then one request per pass)."""
        if self._generate is not None or self.loaded is None:
            return "not used"
        from lockstep.kernels.batching.ragged import enable_ragged, ragged_problem

        problem = ragged_problem(self.loaded.model)
        if problem is None:
            enable_ragged(self.loaded.model)
        else:
            log.warning("requests are not batched into shared passes: %s", problem)
        return problem

    def _make_pool(self, max_kv_tokens: int | None):
        """The shared KV pool when the deployment uses one and passes are batched."""
        if self.deployment.kv_pool == "off" or self.ragged_problem is not None:
            return None
        from lockstep.kernels.batching.kv_pool import KVPool

        capacity = self.max_active * POOL_TOKENS_PER_SLOT
        if max_kv_tokens is not None:
            capacity = min(capacity, max_kv_tokens)
        return KVPool(self.loaded.model, capacity, use_kernel=self.deployment.kv_pool == "kernel")

    def _prove_ragged(self):
        """With a proven limit L, prove ragged passes of 1..L rows too; until proven, a
        deterministic request's rows share no pass with another request's."""
        if self.ragged_problem is not None or not self.deployment.guaranteed:
            return None
        from lockstep.kernels.batching.ragged_selftest import prove_ragged

        kv_pool = self.deployment.kv_pool if self.kv_pool is not None else "off"
        proof = self.deployment.ragged_proof or prove_ragged(self.loaded.model, self.deployment.limit,
                                                             kv_pool=kv_pool)
        if proof:
            log.info("ragged passes of 1..%d rows proven bit-identical to solo passes (%.1f s)",
                     proof.limit, proof.seconds)
        else:
            log.warning("ragged passes not proven (%s): deterministic requests get passes of their own",
                        proof.reason)
        return proof

    def describe(self) -> dict:
        """Batching settings, for /v1/models."""
        limit = self.deployment.limit if self.deployment.guaranteed else 0
        return {"max_active": self.max_active, "max_batch_rows": self.max_batch_rows,
                "deterministic_pass_rows": limit, "max_kv_tokens": self.kv_budget.capacity,
                "batched": self.ragged_problem is None, "kv_pool": self.deployment.kv_pool
                if self.kv_pool is not None else "off",
                "deterministic_rows_shared": bool(self.ragged_proof),
                **({"not_batched_because": self.ragged_problem} if self.ragged_problem else {})}

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._run, name="lockstep-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def _reservation(self, request: GenerationRequest, plan: DecodePlan | None) -> int:
        k = plan.num_draft_tokens if plan else 0
        return reservation(len(request.prompt_tokens), request.max_tokens, k)

    def submit(self, request: GenerationRequest, plan: DecodePlan | None = None) -> RequestHandle:
        """Queue a request; call from the event loop. Output arrives on the handle."""
        return self.submit_group([request], plan)[0]

    def submit_group(self, requests: list[GenerationRequest], plan: DecodePlan | None = None) -> list[RequestHandle]:
        """Queue the choices of one request (same prompt) together: each is generated as a
        request of its own, and all but the first copy the first one's prompt KV instead of
        prefilling it again. All are queued or none."""
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(request, loop, plan) for request in requests]
        for handle in handles[1:]:
            handle.leader = handles[0]
        needed = sum(self._reservation(request, plan) for request in requests)
        if not self.kv_budget.fits_at_all(needed):
            raise TooLargeForMemory(
                f"the prompt and max_tokens need {needed} tokens of KV cache; this server holds at "
                f"most {self.kv_budget.capacity} (--max-kv-tokens): lower max_tokens" +
                (" or n" if len(requests) > 1 else ""))
        with self._wake:
            if self._stopping:
                raise GenerationError("the server is shutting down")
            # Requests about to take a free slot are not "waiting" for the cap's purposes.
            queued = len(self._waiting) + len(handles) - 1 - max(0, self.max_active - len(self._active))
            if self.max_waiting is not None and queued >= self.max_waiting:
                raise QueueFull(f"{max(queued, 0)} requests are already waiting")
            self._waiting.extend(handles)
            self._wake.notify()
        return handles

    def counts(self) -> dict[str, int]:
        """Active and waiting requests now, and requests dropped so far because their client left
        (the one count behind both /health and the `lockstep_cancelled_requests` metric)."""
        with self._wake:
            return {"active": len(self._active), "waiting": len(self._waiting), "cancelled": self._cancelled}

    def cut_off(self, message: str) -> int:
        """End every running and waiting request now with `ShuttingDown(message)`. Returns how many.

        For the drain timeout: each stream then ends with an error event and [DONE] instead of
        being severed mid-body. Call from the event loop.
        """
        with self._wake:
            handles = [a.handle for a in self._active] + list(self._waiting)
        for handle in handles:
            handle.cut = True
            handle.post(ShuttingDown(message))
            handle.cancel()
        return len(handles)

    def _notify(self, method: str, *args) -> None:
        for observer in self.observers:
            call = getattr(observer, method, None)
            if call is None:
                continue  # observers implement the events they care about
            try:
                call(*args)
            except Exception:  # observability must never break serving
                log.exception("engine observer failed")

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while self._admit():
            self._drop_cancelled()
            if self._generate is not None:
                self._step_generators()
            else:
                self._prefill()
                self._decode()
            self._turn += 1
        for active in self._active:
            active.handle.post(GenerationError("the server is shutting down"))
        for handle in self._waiting:
            handle.post(GenerationError("the server is shutting down"))

    def _admit(self) -> bool:
        """Move waiting requests into free slots (FIFO); block while idle. False = stop."""
        with self._wake:
            while not self._stopping and not self._waiting and not self._active:
                self._wake.wait()
            if self._stopping:
                return False
            while self._waiting and len(self._active) < self.max_active:
                handle = self._waiting[0]
                if handle.cancelled:
                    self._waiting.pop(0)
                    self._cancelled += handle.client_cancelled
                    continue
                if self._exclusive_blocks(handle):
                    break  # FIFO: later requests wait too, so nobody overtakes it
                needed = self._reservation(handle.request, handle.plan)
                if not self.kv_budget.try_reserve(needed):
                    break  # FIFO again: it goes first once enough KV is released
                self._waiting.pop(0)
                self._notify("on_admit", time.monotonic() - handle.submitted_at)
                try:
                    work = self._start(handle, needed)
                except Exception as exc:
                    self.kv_budget.release(needed)
                    self._fail(handle, exc)
                    continue
                self._active.append(_Active(handle, work, needed))
            return True

    def _exclusive_blocks(self, handle: RequestHandle) -> bool:
        """An exclusive request runs alone: it waits for an empty engine, and blocks others."""
        if handle.plan is not None and handle.plan.exclusive:
            return bool(self._active)
        return any(a.handle.plan is not None and a.handle.plan.exclusive for a in self._active)

    def _start(self, handle: RequestHandle, reserved: int):
        cancelled = lambda: handle.cancelled  # noqa: E731
        if self._generate is not None:
            return self._generate(self.loaded, handle.request, plan=handle.plan, deployment=self.deployment,
                                  prefix_cache=self.prefix_cache, cancelled=cancelled)
        leader = handle.leader.state if handle.leader is not None else None
        cache = self.kv_pool.allocate(reserved) if self.kv_pool is not None else None
        try:
            handle.state = RequestState(self.loaded, handle.request, plan=handle.plan,
                                        deployment=self.deployment, prefix_cache=self.prefix_cache,
                                        cancelled=cancelled, prefill_from=leader, cache=cache)
        except Exception:
            if cache is not None:
                self.kv_pool.release(cache)
            raise
        return handle.state

    def _remove(self, active: _Active) -> None:
        with self._wake:
            if active in self._active:
                self._active.remove(active)
        self.kv_budget.release(active.reserved)
        if self._generate is not None:
            active.work.close()
        else:
            active.work.closed = True  # a follower of this request prefills on its own now
            if self.kv_pool is not None:
                self.kv_pool.release(active.work.cache)

    def _fail(self, handle: RequestHandle, exc: Exception) -> None:
        log.error("generation failed", exc_info=exc)
        handle.post(GenerationError(f"generation failed: {type(exc).__name__}: {exc}"))

    def _drop_cancelled(self) -> None:
        for active in [a for a in self._active if a.handle.cancelled]:
            self._cancelled += active.handle.client_cancelled
            self._remove(active)

    def _in_turn(self) -> list[_Active]:
        """Active requests, starting with a different one each iteration."""
        n = len(self._active)
        if n == 0:
            return []
        start = self._turn % n
        return self._active[start:] + self._active[:start]

    # ---------------------------------------------------------------- generator mode

    def _step_generators(self) -> None:
        for active in self._in_turn():
            if active.handle.cancelled:
                continue
            try:
                event = next(active.work)
            except StopIteration:  # finished, or gave up inside the step because it was cancelled
                self._cancelled += active.handle.client_cancelled
                self._remove(active)
                continue
            except Exception as exc:  # reaches the client as an error, never a hang
                self._fail(active.handle, exc)
                self._remove(active)
                continue
            if event is not None:
                active.handle.post(event)
                if event.finish_reason is not None:
                    self._remove(active)

    # ------------------------------------------------------------------ batched mode

    def _prefill(self) -> None:
        """Prompt chunks, up to one chunk's worth of tokens per iteration: many short prompts
        start together, a long one still goes a chunk at a time. Chunks of requests with no
        determinism to keep share one pass; the others run in passes of their own."""
        budget = self.deployment.prefill_chunk
        shared: list[_Active] = []
        for active in self._in_turn():
            if budget <= 0:
                break
            if not active.work.prefilling or active.handle.cancelled:
                continue
            tokens = active.work.next_chunk_tokens()
            if tokens > budget and budget < self.deployment.prefill_chunk:
                continue  # too big for what is left of this iteration; its turn to go first comes
            if tokens and active.work.shares_prefill and self.ragged_problem is None:
                shared.append(active)
            else:
                self._prefill_alone(active)
            budget -= tokens
        if len(shared) == 1:
            self._prefill_alone(shared[0])
        elif shared:
            self._prefill_shared(shared)

    def _prefill_alone(self, active: _Active) -> None:
        try:
            active.work.prefill_chunk()
        except Exception as exc:
            self._fail(active.handle, exc)
            self._remove(active)

    def _prefill_shared(self, members: list[_Active]) -> None:
        """One ragged pass over several requests' next prompt chunks."""
        try:
            lengths = shared_prefill(self.loaded.model, [a.work for a in members])
        except Exception as exc:
            for active in members:
                self._fail(active.handle, exc)
                self._remove(active)
            return
        self._notify("on_prefill", sum(lengths), len(members))
        for active, tokens in zip(members, lengths):
            active.work.chunk_written(tokens, alone=False)

    def _draft_room(self) -> "_DraftRoom | None":
        if not self.draft_room or self.ragged_problem is not None:
            return None
        decoding = [a.work for a in self._active if not a.work.prefilling and not a.handle.cancelled]
        limit = self.deployment.limit if self.deployment.guaranteed else 0
        return _DraftRoom(decoding, limit, self.max_batch_rows)

    def _decode(self) -> None:
        demands = []
        room = self._draft_room()
        for active in self._in_turn():
            state = active.work
            if state.prefilling or active.handle.cancelled:
                continue
            try:
                rows = state.rows(room.take(state) if room else None)  # a drafter may run here
                if room:
                    room.claimed[state.deterministic] += len(rows)
            except Exception as exc:
                self._fail(active.handle, exc)
                self._remove(active)
                continue
            if active.handle.cancelled:
                continue
            demands.append(Demand((active, rows), len(rows), state.deterministic))
        if not demands:
            return
        limit = self.deployment.limit if self.deployment.guaranteed else 0
        per_pass = self.max_batch_rows if self.ragged_problem is None else 1
        groups = compose_passes([d for d in demands if not d.deterministic or self.ragged_proof], limit, per_pass)
        groups += [[d] for d in demands if d.deterministic and not self.ragged_proof]
        for group in groups:
            if self.ragged_problem is not None and len(group) > 1:
                raise AssertionError("unbatched passes hold one request")  # max_rows 1 ensures it
            self._run_pass([d.owner for d in group])

    def _run_pass(self, members: list[tuple[_Active, list[int]]]) -> None:
        try:
            logits, argmax = decode_logits(self.loaded.model, [(a.work, rows) for a, rows in members],
                                           ragged=self.ragged_problem is None)
        except Exception as exc:
            for active, _ in members:
                self._fail(active.handle, exc)
                self._remove(active)
            return
        self._notify("on_pass", sum(len(rows) for _, rows in members), len(members))
        spans, end = [], 0
        for _, rows in members:
            spans.append((end, end + len(rows)))
            end += len(rows)
        try:
            sampled = presample_together([a.work for a, _ in members], [logits[b:e] for b, e in spans])
        except Exception:  # each request then samples (and fails, if it must) on its own
            log.exception("batched sampling failed")
            sampled = [None] * len(members)
        posts = []
        for (active, rows), (begin, end), pending in zip(members, spans, sampled):
            try:
                deltas = active.work.take(logits[begin:end], argmax[begin:end], pending)
            except Exception as exc:
                self._fail(active.handle, exc)
                self._remove(active)
                continue
            posts.append((active.handle, deltas))
            if active.work.finished:
                self._remove(active)
        post_all(posts)
