"""Several models behind one server (`serve` with more than one model): each loaded on its first
request (or at start with `--preload`), unloaded after `--idle-unload` seconds without requests,
within a budget of weight bytes (`--models-memory-bytes`) that the least recently used idle model
makes room in; a model with requests in flight is never unloaded.

Each model is its own runtime, engine and guarantee (what `load` returns); nothing here touches
MLX: loading, stopping and reclaiming memory are the caller's functions. Loads and unloads run on
threads of their own; requests wait for a loading model on the event loop (at most
`load_timeout` seconds, then a 503 with Retry-After).

    pool = ModelPool(entries, load, stop, reclaim, budget_bytes=..., idle_unload_s=...)
    async with pool.use(body.model) as submissions:   # 404, or waits for the load, or 503
        return await chat_completion(submissions, body)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from lockstep.server.api.errors import APIError, model_not_found
from lockstep.server.engine import worker_thread
from lockstep.server.engine.guarantee.guarantee_state import PROVING

log = logging.getLogger("lockstep.models")

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
STATES = (UNLOADED, LOADING, LOADED)
MODEL_ALIAS = "default"  # the served model; of several, the first
# `<model>:deterministic` asks for deterministic mode by the model's name (listed beside it)
DETERMINISTIC_SUFFIX = ":deterministic"
DEFAULT_LOAD_TIMEOUT_S = 120.0
LOAD_RETRY_AFTER_S = 5
# How often the idle watcher looks, as a share of --idle-unload (at most once a second).
IDLE_CHECKS_PER_PERIOD = 4


@dataclass
class ModelEntry:
    """One configured model: the id it is served as and the options its runtime is built with
    (server/commands/models_config.py reads them)."""

    name: str
    options: dict = field(default_factory=dict)  # model, weights, quantize, q_bits, q_group_size, draft_model


@dataclass
class LoadedService:
    """What `load` returns for a model: its started engine, its /v1/models details (a function:
    the guarantee's state changes) and the bytes its weights take."""

    engine: object
    info: Callable[[], dict]
    nbytes: int
    submissions: object = None  # set by the pool (`make_submissions`)


class PooledModel:
    def __init__(self, entry: ModelEntry):
        self.entry = entry
        self.name = entry.name
        self.state = UNLOADED
        self.service: LoadedService | None = None
        self.leases = 0  # requests between `use` and their submission to the engine
        self.last_used = 0.0
        self.nbytes: int | None = None  # measured at its first load
        self.loads = self.unloads = 0
        self.problem = ""  # why its last load failed
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def busy(self) -> bool:
        """Requests in flight: leased, or queued or running in its engine."""
        if self.leases:
            return True
        if self.service is None:
            return False
        counts = self.service.engine.counts()
        return bool(counts["active"] or counts["waiting"])


class ModelPool:
    def __init__(self, entries: list[ModelEntry], load: Callable[[ModelEntry], LoadedService],
                 stop: Callable[[LoadedService], None], reclaim: Callable[[], None] = lambda: None, *,
                 budget_bytes: int | None = None, idle_unload_s: float | None = None,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        if not entries:
            raise ValueError("no models to serve")
        names = [e.name for e in entries]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two models are named {name!r}: give each its own name")
            if name == MODEL_ALIAS or name.endswith(DETERMINISTIC_SUFFIX) or not name:
                raise ValueError(f"{name!r} cannot name a model (\"default\" names the first one; "
                                 f"{DETERMINISTIC_SUFFIX!r} asks for deterministic mode)")
        if budget_bytes is not None and budget_bytes < 1:
            raise ValueError("--models-memory-bytes must be >= 1")
        if idle_unload_s is not None and not idle_unload_s > 0:
            raise ValueError("--idle-unload must be > 0")
        if not load_timeout_s >= 0:
            raise ValueError("--load-timeout must be >= 0")
        self.models = {e.name: PooledModel(e) for e in entries}
        self.default = entries[0].name
        self._load, self._stop, self._reclaim = load, stop, reclaim
        self.budget_bytes, self.idle_unload_s, self.load_timeout_s = budget_bytes, idle_unload_s, load_timeout_s
        self.clock = clock
        self.make_submissions: Callable[[LoadedService, str], object] = lambda service, name: None
        self.on_load: list[Callable[[LoadedService], None]] = []  # e.g. metrics observe its engine
        self.cancelled_before = 0  # cancellations counted by engines since unloaded (a counter never falls)
        self.ahead_before: dict[str, int] = {}  # decode passes built ahead by engines since unloaded (the same)
        self._lock = threading.Condition()
        self._closing = False
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, preload: bool = False) -> "ModelPool":
        """Load every model now with `preload` (in order; the budget may unload earlier ones),
        and start the idle watcher where --idle-unload is set."""
        if preload:
            for model in self.models.values():
                with self._lock:
                    victims = self._begin_load(model)
                self._run_load(model, victims)
                if model.problem:
                    raise ValueError(f"model {model.name!r}: {model.problem}")
        if self.idle_unload_s is not None:
            self._watcher = threading.Thread(target=self._watch_idle, name="lockstep-idle-unload", daemon=True)
            self._watcher.start()
        return self

    def stop(self) -> None:
        """Stop the watcher and every loaded engine (at shutdown)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
            services = [m.service for m in self.models.values() if m.service is not None]
        for service in services:
            self._stop(service)

    # ------------------------------------------------------------------ requests

    def find(self, name: str) -> PooledModel:
        """The model `name` asks for (its id or "default", either with the deterministic
        suffix); 404 otherwise."""
        base = name.removesuffix(DETERMINISTIC_SUFFIX)
        model = self.models.get(self.default if base == MODEL_ALIAS else base)
        if model is None:
            raise model_not_found(name)
        return model

    @contextlib.asynccontextmanager
    async def use(self, name: str):
        """The submissions of model `name`, loaded (a load started here where it is unloaded, waited
        for at most the load timeout); it is not unloaded before the block ends."""
        model = self.find(name)
        deadline = time.monotonic() + self.load_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if model.state == LOADED:
                    model.leases += 1
                    submissions = model.service.submissions
                    break
                if model.state == UNLOADED:
                    self._start_load(model)  # 503 where the budget has no room
                future = loop.create_future()
                model.waiters.append((loop, future))
            try:
                await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                with self._lock:
                    model.waiters = [w for w in model.waiters if w[1] is not future]
                raise APIError(503, f"the model {model.name!r} is still loading; retry shortly",
                               type="server_error", param="model", code="model_loading",
                               headers={"Retry-After": str(LOAD_RETRY_AFTER_S)}) from None
            with self._lock:
                if model.state == UNLOADED and model.problem:
                    raise APIError(500, f"the model {model.name!r} could not be loaded: {model.problem}",
                                   type="server_error", param="model", code="model_load_failed")
        try:
            yield submissions
        finally:
            with self._lock:
                model.leases -= 1
                model.last_used = self.clock()

    # ------------------------------------------------------------------ loading

    def _start_load(self, model: PooledModel) -> None:
        """Under the lock: room made (or a 503), the model marked loading, its load started."""
        victims = self._begin_load(model)
        worker_thread.start(lambda: self._run_load(model, victims), name=f"lockstep-load-{model.name}")

    def _estimate(self, model: PooledModel) -> int:
        """Bytes a model's weights take: measured at its last load; before its first, the largest
        model measured so far (else nothing is known and no room is made before it loads)."""
        if model.nbytes is not None:
            return model.nbytes
        return max((m.nbytes for m in self.models.values() if m.nbytes is not None), default=0)

    def _held_bytes(self, besides: PooledModel | None = None) -> int:
        return sum(self._estimate(m) for m in self.models.values() if m is not besides and m.state != UNLOADED)

    def _victims(self, needed: int, besides: PooledModel) -> list[PooledModel] | None:
        """Least recently used idle loaded models whose unloading fits `needed` more bytes into
        the budget ([] where it fits already; None where even unloading every idle one does not)."""
        if self.budget_bytes is None:
            return []
        over = self._held_bytes(besides) + needed - self.budget_bytes
        victims = []
        for other in sorted(self.models.values(), key=lambda m: m.last_used):
            if over <= 0:
                break
            if other is besides or other.state != LOADED or other.busy():
                continue
            victims.append(other)
            over -= self._estimate(other)
        return victims if over <= 0 else None

    def _begin_load(self, model: PooledModel) -> list[PooledModel]:
        """Under the lock: the victims taken out of service and the model marked loading."""
        needed = self._estimate(model)
        if self.budget_bytes is not None and needed > self.budget_bytes:
            raise APIError(503, f"the model {model.name!r} needs {needed} bytes, more than the "
                                f"{self.budget_bytes} of --models-memory-bytes", type="server_error",
                           param="model", code="model_over_memory_budget",
                           headers={"Retry-After": str(LOAD_RETRY_AFTER_S)})
        victims = self._victims(needed, model)
        if victims is None:
            raise APIError(503, f"no room to load the model {model.name!r}: the other models in "
                                f"--models-memory-bytes ({self.budget_bytes}) have requests in flight; retry shortly",
                           type="server_error", param="model", code="model_memory_busy",
                           headers={"Retry-After": str(LOAD_RETRY_AFTER_S)})
        taken = [self._take_out(victim, "to make room in the memory budget") for victim in victims]
        model.state, model.problem = LOADING, ""
        return taken

    def _run_load(self, model: PooledModel, victims: list[tuple[PooledModel, LoadedService]]) -> None:
        """On a thread of its own: unload the victims, load the model, wake its waiters."""
        self._release(victims)
        started = time.perf_counter()
        try:
            service = self._load(model.entry)
            service.submissions = self.make_submissions(service, model.name)
            for hook in self.on_load:
                hook(service)
        except Exception as exc:  # the model stays unloaded; its requests get the reason
            log.error("model %s not loaded: %s", model.name, exc)
            with self._lock:
                model.state, model.problem = UNLOADED, f"{type(exc).__name__}: {exc}"
                self._wake(model)
            return
        with self._lock:
            model.service, model.nbytes, model.state = service, service.nbytes, LOADED
            model.loads += 1
            model.last_used = self.clock()
            # the estimate may have been low: the measured size may need more room
            more = self._victims(0, model) or []
            extra = [self._take_out(victim, "to make room in the memory budget") for victim in more]
            self._wake(model)
        log.info("model %s loaded in %.1fs (%d bytes of weights)", model.name, time.perf_counter() - started,
                 service.nbytes)
        self._release(extra)

    def _wake(self, model: PooledModel) -> None:
        waiters, model.waiters = model.waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)
        self._lock.notify_all()

    # ------------------------------------------------------------------ unloading

    def _take_out(self, model: PooledModel, why: str) -> tuple[PooledModel, LoadedService]:
        """Under the lock: the model marked unloaded (new requests load it again); its service,
        for `_release` to stop outside the lock."""
        service, model.service, model.state = model.service, None, UNLOADED
        self.cancelled_before += service.engine.counts()["cancelled"]
        for key, value in service.engine.decode_ahead_counts().items():
            self.ahead_before[key] = self.ahead_before.get(key, 0) + value
        log.info("model %s unloaded %s", model.name, why)
        return model, service

    def _release(self, taken: list[tuple[PooledModel, LoadedService]]) -> None:
        """Stop the taken services' engines, drop them and give their memory back; then count
        the unloads (a model's `unloads` counts unloads whose memory is back)."""
        if not taken:
            return
        models = [model for model, _ in taken]
        for _, service in taken:
            self._stop(service)
        del service  # the reclaim below must find no reference left
        taken.clear()
        self._reclaim()
        with self._lock:
            for model in models:
                model.unloads += 1

    def unload_idle(self) -> int:
        """Unload every loaded model idle for --idle-unload seconds; returns how many."""
        now = self.clock()
        with self._lock:
            idle = []
            for model in self.models.values():
                if model.state != LOADED:
                    continue
                if model.busy():
                    model.last_used = now  # idle counts from its last request's end
                elif now - model.last_used >= self.idle_unload_s:
                    idle.append(self._take_out(model, f"after {self.idle_unload_s:g}s idle"))
        count = len(idle)
        self._release(idle)
        return count

    def _watch_idle(self) -> None:
        period = min(1.0, self.idle_unload_s / IDLE_CHECKS_PER_PERIOD)
        while True:
            with self._lock:
                self._lock.wait(period)
                if self._closing:
                    return
            try:
                self.unload_idle()
            except Exception:  # the watcher must outlive one failed unload
                log.exception("idle unload failed")

    # ------------------------------------------------------------------ reporting

    def loaded_engines(self) -> list:
        with self._lock:
            return [m.service.engine for m in self.models.values() if m.service is not None]

    def counts(self) -> dict[str, int]:
        """Active, waiting and cancelled requests over every model (cancelled: since start)."""
        return self._summed(lambda engine: engine.counts(),
                            {"active": 0, "waiting": 0, "cancelled": self.cancelled_before})

    def decode_ahead_counts(self) -> dict[str, int]:
        """Decode passes built ahead, taken over and dropped since start, over every model's
        engines (an unloaded model's kept)."""
        return self._summed(lambda engine: engine.decode_ahead_counts(), self.ahead_before)

    def _summed(self, counts_of, start: dict[str, int]) -> dict[str, int]:
        """`start` plus `counts_of(engine)` of every loaded engine, key by key."""
        total = dict(start)
        for engine in self.loaded_engines():
            for key, value in counts_of(engine).items():
                total[key] = total.get(key, 0) + value
        return total

    def status(self, model: PooledModel) -> dict:
        """A model's state, guarantee and load counts (/health, /v1/models, /metrics)."""
        service = model.service
        guarantee = service.engine.guarantee.state if service is not None else None
        return {"state": model.state, "guarantee": guarantee, "loads": model.loads, "unloads": model.unloads,
                **({"weights_bytes": model.nbytes} if model.nbytes is not None else {}),
                **({"load_problem": model.problem} if model.problem else {}),
                **(service.engine.counts() if service is not None else {})}

    @property
    def failure(self) -> str | None:
        """The first loaded model whose engine stopped after an error, and why (None: none)."""
        with self._lock:
            failed = [(m.name, m.service.engine.failure) for m in self.models.values()
                      if m.service is not None and getattr(m.service.engine, "failure", None) is not None]
        return f"{failed[0][0]}: {failed[0][1]}" if failed else None

    def proving(self) -> bool:
        return any(engine.guarantee.state == PROVING for engine in self.loaded_engines())


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
