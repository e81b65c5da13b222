"""The engine: one worker thread owns MLX and runs the step loop.

A deployment that proves its guarantee after serving started hands that work to `start`: the
worker thread runs it first, serving plain passes between its steps (kernels/proof_steps.py),
and installs the deployment it returns (deterministic requests are planned with the proven one).

    while requests are waiting or active:
        admit (scheduler)
        SchedulerOutput = scheduler.schedule_prefill()  -> runner.execute -> scheduler.update_from_output
        SchedulerOutput = scheduler.schedule_decode()   -> runner.execute -> scheduler.update_from_output

The scheduler (server/engine/scheduling/scheduler.py) decides what runs, the model runner
(server/engine/runner/model_runner.py) runs it, and each request's output goes back to asyncio
through its `RequestHandle`, one event-loop wake-up per pass. Nothing here knows HTTP; all
MLX work happens on the worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import mlx.core as mx

from lockstep.kernels.audit.widths import AuditedRows
from lockstep.server.engine.guarantee.decode_plan import DecodePlan

from lockstep.server.engine.guarantee.deployment import Deployment
from lockstep.kernels.proof_steps import between_steps
from lockstep.server.engine.scheduling.errors import GenerationError, QueueFull, ShuttingDown, TooLargeForMemory
from lockstep.server.engine.guarantee.guarantee_state import REFUSED, GuaranteeState, settled_state
from lockstep.server.engine.scheduling.handle import RequestHandle, post_all
from lockstep.server.engine.scheduling.kv_budget import KVBudget, device_memory, reservation
from lockstep.server.engine.runner.decode_ahead import AHEAD_OUTCOMES
from lockstep.server.engine.runner.model_runner import ModelRunner
from lockstep.server.engine.scheduling.passes import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS, default_active_per_request
from lockstep.server.engine.cache.prefix_cache import PrefixCache
from lockstep.server.engine.decoding.request_state import GenerationRequest
from lockstep.server.engine.scheduling.scheduler import Scheduler
from lockstep.server.engine.runner.step_data import SchedulerOutput
from lockstep.server.engine import worker_thread

log = logging.getLogger(__name__)

# Initial KV pool size per `max_active` slot (the pool doubles when a request needs more, up to the KV budget).
POOL_TOKENS_PER_SLOT = 1024
STOP_FLUSH_S = 30.0  # a stopping engine waits this long for the prompt cache's queued disk writes
# While proofs run on the worker thread, requests get it between their steps for as long as
# the last step took (half and half: a proof step takes a second or more on a loaded CPU, and
# a first answer waited one per quarter second of its own decoding), at least the floor and
# at most the cap (so steady traffic cannot hold the guarantee back for ever).
SERVE_BETWEEN_PROOF_STEPS_S = 0.25
SERVE_BETWEEN_PROOF_STEPS_MAX_S = 2.0
# A step at least this long is logged at DEBUG with what it ran (a first start's steps wait on
# kernel compiles: `--log-level DEBUG` shows which).
SLOW_STEP_S = 0.1


class _Stopped(Exception):
    """The engine stopped while its proofs were running."""


class Work:
    """What `Engine.start` may run first, in order (server/startup_work.py GuaranteeWork, DraftWork):
    `run()` returns the deployment to serve with from then on, `settle()` then says so to
    whoever waits for it. `install` (set by the engine before `run()`): a deployment to serve
    with at once, while the work goes on (the guarantee in force for the widths proven so far)."""

    install = None

    def run(self) -> Deployment: ...

    def settle(self) -> None: ...


class EngineObserver:
    """What the engine reports as it runs (metrics implement it); every method is optional."""

    def on_pass(self, rows: int, requests: int) -> None: ...

    def on_pass_seconds(self, seconds: float, deterministic: bool) -> None: ...

    def on_prefill(self, rows: int, requests: int) -> None: ...

    def on_admit(self, waited_seconds: float) -> None: ...


class Engine:
    max_waiting: int | None = None  # waiting requests before submit() refuses; None = unbounded

    def __init__(self, loaded, max_active: int = DEFAULT_MAX_ACTIVE, *, deployment: Deployment | None = None,
                 prefix_cache: PrefixCache | None = None, max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
                 max_kv_tokens: int | None = None, max_active_per_request: int | None = None,
                 runner: ModelRunner | None = None, guarantee: GuaranteeState | None = None,
                 audited: AuditedRows | None = None):
        if max_active < 1 or max_batch_rows < 1:
            raise ValueError("max_active and max_batch_rows must be >= 1")
        per_request = max_active_per_request or default_active_per_request(max_active)
        if not 1 <= per_request <= max_active:
            raise ValueError("max_active_per_request must be in 1..max_active")
        self.loaded = loaded
        self.deployment = deployment or Deployment()
        # where the guarantee stands (proving while `start`'s proofs run); /health says it
        self.guarantee = guarantee or GuaranteeState(settled_state(self.deployment))
        if runner is None:
            pool_tokens = max_active * POOL_TOKENS_PER_SLOT
            if max_kv_tokens is not None:
                pool_tokens = min(pool_tokens, max_kv_tokens)
            runner = ModelRunner(loaded.model, self.deployment, pool_tokens=pool_tokens, pool_max_tokens=max_kv_tokens)
        self.runner = runner
        self.kv_budget = KVBudget(max_kv_tokens)
        # the call widths the kernel audit has covered (the rest is audited by `start`'s work)
        self.audited = audited or AuditedRows()
        self.scheduler = Scheduler(loaded, runner, deployment=self.deployment, max_active=max_active,
                                   active_per_request=per_request, max_batch_rows=max_batch_rows,
                                   kv_budget=self.kv_budget, prefix_cache=prefix_cache, audited=self.audited)
        self.scheduler.on_admit = lambda waited: self._notify("on_admit", waited)
        self.scheduler.on_fail = self._fail
        self.observers: list[EngineObserver] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: worker_thread.Job | None = None
        self._work: list[Work] = []
        self.starting = False  # start-up work (audit, proofs, draft model) still running; /health says it
        # why the worker thread's loop ended in an error (None: running, or stopped cleanly);
        # /health answers 503 and `serve` exits 1 (server/api/shutdown.py)
        self.failure: str | None = None

        self._proof_resumed_at = 0.0  # when the running proof last got the thread back

    @property
    def max_active(self) -> int:
        return self.scheduler.max_active

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.scheduler.prefix_cache

    def describe(self) -> dict:
        """Batching settings, for /v1/models."""
        return self.scheduler.describe()

    def kv_room(self, prompt_tokens: int, draft_tokens: int = 0) -> int | None:
        """Tokens the KV budget leaves a request of `prompt_tokens` to generate (None:
        unbounded; below 1: the prompt alone does not fit)."""
        if self.kv_budget.capacity is None:
            return None
        return self.kv_budget.capacity - reservation(prompt_tokens, 0, draft_tokens)

    def start(self, work: list[Work] | None = None) -> "Engine":
        """Start the worker thread; it runs `work` first (the deployment's proofs, then its draft
        model), serving plain requests between their steps."""
        self._work = list(work or [])
        self.starting = bool(self._work)
        self._thread = worker_thread.start(self._run, name="lockstep-engine")
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        if self.prefix_cache is not None and not self.prefix_cache.flush(STOP_FLUSH_S):
            log.warning("prompt cache: writes still queued after %g s were not kept", STOP_FLUSH_S)

    # ---------------------------------------------------------------- event loop side

    def submit(self, request: GenerationRequest, plan: DecodePlan | None = None) -> RequestHandle:
        """Queue a request; call from the event loop. Output arrives on the handle."""
        return self.submit_group([request], plan)[0]

    def submit_group(self, requests: list[GenerationRequest], plan: DecodePlan | None = None) -> list[RequestHandle]:
        """Queue the choices of one request (same prompt) together: each is generated as a
        request of its own, and all but the first copy the first one's prompt KV instead of
        prefilling it again. All are queued or none; the group counts as one request
        against `max_waiting`."""
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(request, loop, plan) for request in requests]
        for handle in handles[1:]:
            handle.leader = handles[0]
        needed = self.scheduler.kv_needed_at_once(handles)
        if not self.kv_budget.fits_at_all(needed):
            raise TooLargeForMemory(
                f"the prompt and max_tokens need {needed} tokens of KV cache; this server holds at "
                f"most {self.kv_budget.capacity} (--max-kv-tokens): lower max_tokens" +
                (" or n" if len(requests) > 1 else ""))
        with self._wake:
            if self._stopping:
                raise GenerationError(self._refusal())
            waiting = self.scheduler.waiting_requests()
            free = max(0, self.scheduler.max_active - len(self.scheduler.active))
            if self.max_waiting is not None and waiting + 1 - free > self.max_waiting:
                raise QueueFull(f"{waiting} requests are already waiting")
            self.scheduler.waiting.extend(handles)
            self._wake.notify()
        return handles

    def counts(self) -> dict[str, int]:
        """Active and waiting requests now, and requests dropped so far because their client left
        (the one count behind both /health and the `lockstep_cancelled_requests` metric)."""
        with self._wake:
            return {"active": len(self.scheduler.active), "waiting": len(self.scheduler.waiting),
                    "cancelled": self.scheduler.cancelled}

    def decode_ahead_counts(self) -> dict[str, int]:
        """Decode passes built ahead so far, and of them those taken over and those dropped
        (server/engine/runner/decode_ahead.py; all 0 where passes are not compiled)."""
        runner = self.runner
        return {outcome: getattr(runner, f"ahead_{outcome}", 0) for outcome in AHEAD_OUTCOMES}

    def cut_off(self, message: str) -> int:
        """End every running and waiting request now with `ShuttingDown(message)`. Returns how many.

        For the drain timeout: each stream then ends with an error event and [DONE] instead of
        being severed mid-body. Call from the event loop.
        """
        with self._wake:
            handles = [s.handle for s in self.scheduler.active] + list(self.scheduler.waiting)
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
        try:
            for work in self._work:
                if not self._run_work(work):
                    break
            self.starting = False
            while self._admit():
                self._iterate()
        except Exception as exc:  # beyond one request (the device, the model): nothing more runs
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("the engine stopped after an error: its requests fail, and so does the server")
            self.starting = False
        self._end_all(GenerationError(self._refusal()))

    def _refusal(self) -> str:
        """What a request the engine no longer runs is told."""
        if self.failure is None:
            return "the server is shutting down"
        return f"the engine stopped after an error ({self.failure})"

    def _end_all(self, error: GenerationError) -> None:
        """Stop taking requests; end every running and waiting one with `error` (worker thread)."""
        with self._wake:
            self._stopping = True
            handles = [slot.handle for slot in self.scheduler.active] + list(self.scheduler.waiting)
        for handle in handles:
            handle.post(error)

    def _iterate(self) -> None:
        scheduler = self.scheduler
        scheduler.drop_cancelled()
        self._step(scheduler.schedule_prefill())
        self._step(scheduler.schedule_decode())
        scheduler.turn += 1

    def set_deployment(self, deployment: Deployment) -> None:
        """Plan and run from now on with `deployment` (worker thread, between steps)."""
        self.deployment = deployment
        self.scheduler.set_deployment(deployment)
        self.runner.set_deployment(deployment)

    def _run_work(self, work: Work) -> bool:
        """Run one piece of start-up work, serving requests between its steps. False: stop."""
        work.install = self.set_deployment

        self._proof_resumed_at = time.perf_counter()  # the first step is timed from here
        try:
            with between_steps(self._serve_between_proof_steps):
                deployment = work.run()
        except _Stopped:
            return False
        except Exception as exc:  # the deployment then guarantees nothing; plain serving goes on
            log.error("start-up work failed: deterministic requests get no guarantee", exc_info=exc)
            self._after_work(work)
            if not self.guarantee.settled:
                self.guarantee.settle(REFUSED, f"the proof failed: {type(exc).__name__}: {exc}")
            return True
        self.set_deployment(deployment)
        work.settle()
        self._after_work(work)
        return True

    @staticmethod
    def _after_work(work: Work) -> None:
        """Give a piece of work's freed buffers back to the device and log its memory. MLX keeps
        freed buffers in its cache, where allocations outside its pool (CUDA graphs, a draft
        model's load) cannot reach them."""
        memory = device_memory()
        if memory is not None:
            mx.clear_cache()
            log.info("device memory after %s: %s", type(work).__name__, device_memory())

    def _serve_between_proof_steps(self) -> None:
        """A proof finished a step: serve the requests there are, for as long as the step took
        (within the floor and the cap)."""
        now = time.perf_counter()
        step = now - self._proof_resumed_at
        deadline = now + min(max(step, SERVE_BETWEEN_PROOF_STEPS_S), SERVE_BETWEEN_PROOF_STEPS_MAX_S)
        served = 0
        try:
            while time.perf_counter() < deadline:
                with self._wake:
                    if self._stopping:
                        raise _Stopped
                    if not self.scheduler.waiting and not self.scheduler.active:
                        return
                    self.scheduler.admit()
                self._iterate()
                served += 1
        finally:
            self._proof_resumed_at = time.perf_counter()
            if served:
                log.debug("between proof steps (the last took %.3f s): %d turns served in %.3f s",
                          step, served, self._proof_resumed_at - now)

    def _admit(self) -> bool:
        """Move waiting requests into free slots; block while idle. False = stop."""
        with self._wake:
            while not self._stopping and not self.scheduler.waiting and not self.scheduler.active:
                self._wake.wait()
            if self._stopping:
                return False
            self.scheduler.admit()
            return True

    def _step(self, output: SchedulerOutput) -> None:
        if output.empty:
            return
        debug = log.isEnabledFor(logging.DEBUG)
        started, traced = time.perf_counter(), self._traces() if debug else 0
        result = self.runner.execute(output)
        seconds = time.perf_counter() - started
        if debug and seconds >= SLOW_STEP_S:
            log.debug("a step of %.3f s: %s, %d compiled passes traced", seconds, describe_step(output, result),
                      self._traces() - traced)
        posts = self.scheduler.update_from_output(output, result)
        if output.prefill_shared and not isinstance(result.prefill_shared, Exception):
            self._notify("on_prefill", sum(result.prefill_shared), len(output.prefill_shared))
        for scheduled, done in zip(output.passes, result.passes):
            if not isinstance(done, Exception) and done.rows:
                self._notify("on_pass", done.rows, done.requests)
                self._notify("on_pass_seconds", done.seconds, scheduled.canonical)
        post_all(posts)

    def _traces(self) -> int:
        compiled = getattr(self.runner, "compiled", None)
        return compiled.traces if compiled is not None else 0

    def _fail(self, handle: RequestHandle, exc: Exception) -> None:
        if isinstance(exc, GenerationError):  # meant for the client (e.g. a grammar-engine limit): no traceback
            log.warning("generation stopped: %s", exc)
            handle.post(exc)
            return
        log.error("generation failed", exc_info=exc)
        handle.post(GenerationError(f"generation failed: {type(exc).__name__}: {exc}"))


def describe_step(output: SchedulerOutput, result) -> str:
    """What one engine step ran, for the slow-step log: prompt chunks (alone, shared) with their
    tokens, decode passes with their rows."""
    alone = [r for r in result.prefill_alone if not isinstance(r, Exception)]
    shared = result.prefill_shared if not isinstance(result.prefill_shared, Exception) else []
    passes = [p for p in result.passes if not isinstance(p, Exception)]
    return (f"{len(output.prefill_alone)} prompt chunks alone ({sum(r.tokens for r in alone)} tokens), "
            f"{len(output.prefill_shared)} shared ({sum(shared)} tokens), {len(output.passes)} decode passes "
            f"({sum(p.rows for p in passes)} rows)")
