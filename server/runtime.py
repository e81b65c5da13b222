"""Assemble what a deployment serves: model → quantize → kernel audit → batch invariance.

Shared by `lockstep serve`, `verify` and `bench`, so every command runs the model exactly
as the server would. No HTTP here (the device runs this without fastapi).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from lockstep.server.engine.decode_plan import METHODS

from lockstep.server.engine.deployment import (CPU_PLAIN_PREFILL_CHUNK, CPU_PREFILL_CHUNK, MAX_DRAFT_TOKENS,
                                               PREFILL_CHUNK, Deployment, rewind_refusal)
from lockstep.server.engine.guarantee import PENDING_STRATEGY, Guarantee
from lockstep.server.engine.guarantee_state import OFF, PROVING, REFUSED, GuaranteeState, settled_state
from lockstep.server.options import (AUDIT_MODES, DEFAULT_MAX_BATCH_ROWS, DEFAULT_NUM_DRAFT_TOKENS,
                                     DEFAULT_PREFILL_CHUNK)

log = logging.getLogger("lockstep.runtime")

AUDIT_OFF_WARNING = ("quantized kernels NOT audited (--audit off): a faulty kernel path "
                     "would go unnoticed")
_IMPORTED_AT = time.perf_counter()

LIMIT_ENV = ("LOCKSTEP_BATCH_INVARIANT_LIMIT", "MLX_METAL_BATCH_INVARIANT_LIMIT")


def limit_from_env(environ=os.environ) -> int:
    """L from the environment: lockstep's own name first, then the upstream MLX name."""
    for name in LIMIT_ENV:
        value = environ.get(name, "").strip()
        if value:
            try:
                limit = int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
            if limit < 0:
                raise ValueError(f"{name}={value!r} must be >= 0")
            return limit
    return 0


@dataclass
class Options:
    model: str = "default"
    weights: str = "auto"
    quantize: str | None = None
    q_bits: int | None = None
    q_group_size: int | None = None
    batch_invariant_limit: int = 0
    invariant_strategy: str = "auto"
    speculative: str = "none"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    adaptive_speculation: bool = False  # k per step from each request's own acceptance
    draft_backoff: bool = True  # otherwise cheap drafters stop verifying drafts after a miss
    draft_model: str | None = None  # a model spec, or "default-quantized"
    # Draft only where it pays (serve): `default-quantized` only in a form cheaper than the target
    # here, any draft measured against it (assess_draft). False (verify, bench): loaded as named,
    # whatever it costs, since they check or measure drafting itself.
    draft_where_it_pays: bool = True
    # q/k/v and gate/up each as one matmul (models/fused_projections.py), before the audit
    fuse_projections: bool = False
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK  # None: default_prefill_chunk()
    audit: str = "cached"  # one of AUDIT_MODES (server/options.py says what each does)
    # Applied to the loaded, audited model before batch invariance (distributed sharding,
    # server/distributed/sharding.py); returns a label appended to the model's transform.
    prepare_model: Callable[[object], str] | None = None
    reuse_proofs: bool = True  # False: self-test proofs are made afresh (every rank the same passes)
    # Requests' KV in one shared pool with one attention launch per pass (kernels/batching/kv_pool.py):
    # "auto" = where the GPU kernel is available, "on" = also elsewhere (one attention call
    # per row), "off".
    kv_pool: str = "off"
    # The widest pass the engine builds (`serve --max-batch-rows`): the ragged proof covers it.
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    # Decode passes start evaluating every this many layers while the rest is built; 0: off.
    async_eval_layers: int = 0
    # Plain decode passes over the pool's kernel as one compiled call per row count.
    compiled_passes: bool = True
    # The next compiled decode pass built while the device runs this one (server/engine/decode_ahead.py).
    decode_ahead: bool = True


def seconds_since_process_start() -> float:
    """Wall time since this process started (Linux /proc), else since this module loaded."""
    try:
        stat = open("/proc/self/stat").read()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


class Phases(dict):
    """Seconds per startup phase (import, load, quantize, audit, fingerprint, self_test,
    warm_up), in the order they ran; a phase met twice (the draft model's load) adds up.
    `compile`: the custom kernels' NVRTC seconds per phase where there were any (added up over
    the threads that compile them concurrently, so it may exceed the phase's own time)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.compile: dict[str, float] = {}

    @contextmanager
    def timed(self, phase: str):
        from lockstep.kernels.custom.compiled import compile_seconds

        start, compiled = time.perf_counter(), compile_seconds()
        try:
            yield
        finally:
            self[phase] = self.get(phase, 0.0) + time.perf_counter() - start
            spent = compile_seconds() - compiled
            if spent > 0:
                self.compile[phase] = self.compile.get(phase, 0.0) + spent

    def line(self) -> str:
        return ", ".join(f"{k.replace('_', '-')} {v:.1f}s" + (f" (compile {self.compile[k]:.1f}s)" if k in self.compile else "")
                         for k, v in self.items())


@dataclass
class Runtime:
    loaded: object  # models.load.LoadedModel
    deployment: Deployment
    audit: object  # kernels.audit.report.AuditReport
    invariance: object  # kernels.invariance.limit.InstalledInvariance: the mechanism installed (None: not yet)
    transform: str
    timings: dict = field(default_factory=dict)  # startup phase -> seconds (Phases)
    audit_mode: str = "cached"
    # Why this model's requests neither speculate nor start from the prefix cache (None: they
    # may): state that cannot be rewound or stored exactly (`state_refusal`).
    state_refusal: str | None = None
    guarantee: GuaranteeState = field(default_factory=GuaranteeState)  # proving, in force, refused, off
    pending: list | None = None  # work for the engine thread after serving starts (GuaranteeWork, DraftWork)
    guarantee_seconds: float | None = None  # how long the proofs took, once they ran
    # the call widths the kernel audit has covered (kernels/audit/widths.py); the engine's gate
    audited: object = field(default_factory=lambda: _all_audited())
    serving_after_s: float | None = None  # the phases before serving (the proofs' only when not deferred)
    admission: object = None  # server.engine.admission.Admission the engine serves with (serve only)

    def set_admission(self, admission) -> None:
        """Serve with `admission` (server/engine/admission.py): its pass width is the widest the
        engine builds, so a ragged proof still to run covers every width up to it. A proof already
        made (not deferred) covered `Options.max_batch_rows`, which must then be that width."""
        self.admission = admission
        for work in self.pending or ():
            if isinstance(work, GuaranteeWork):
                work.options = dataclasses.replace(work.options, max_batch_rows=admission.max_batch_rows)

    def model_info(self) -> dict:
        """Per-model details for GET /v1/models."""
        from lockstep.kernels.audit import summary

        audit = ({"mode": "off", "warning": AUDIT_OFF_WARNING} if self.audit is None
                 else {"mode": self.audit_mode, **summary(self.audit), **self.audited.describe()})
        test = getattr(self.invariance, "self_test", None)
        guarantee = self.deployment.guarantee
        return {
            "audit": audit,
            "startup": {"phases_s": {k: round(v, 2) for k, v in self.timings.items()},
                        "total_s": round(sum(self.timings.values()), 2),
                        **({"serving_after_s": round(self.serving_after_s, 2)} if self.serving_after_s else {}),
                        **({"compile_s": {k: round(v, 2) for k, v in self.timings.compile.items()}}
                           if getattr(self.timings, "compile", None) else {}),
                        **({"guarantee_s": round(self.guarantee_seconds, 2)}
                           if self.guarantee_seconds is not None else {}),
                        "self_test_cached": bool(test is not None and test.cached)},
            "batch_invariance": {
                "state": self.guarantee.state,
                "limit": guarantee.call_rows, "strategy": guarantee.strategy,
                "guaranteed": guarantee.proven, "reason": guarantee.reason,
                "request_rows": guarantee.request_rows,
            },
            "speculation": self._speculation(),
            "prefix_cache": {"stores_prompts": self.state_refusal is None,
                             **({"reason": self.state_refusal} if self.state_refusal else {})},
            "transform": self.transform,
            **({"admission": self.admission.describe()} if self.admission is not None else {}),
            "draft_model": self.deployment.draft_name,
            **({"draft_model_state": "loading"} if self.deployment.draft_loading else
               {"draft_model_state": f"failed: {self.deployment.draft_problem}"} if self.deployment.draft_problem
               else {"draft_model_state": f"not drafted from: {self.deployment.draft_refusal}"}
               if self.deployment.draft_refusal else {}),
            **({"draft_costs": self.deployment.draft_costs.describe()} if self.deployment.draft_costs else {}),
        }


    def _speculation(self) -> dict:
        """Whether requests may speculate; where not, why (worded for the model's kind of state)
        and what a request that asks for it gets (server/engine/decode_plan.py)."""
        if self.deployment.speculation:
            return {"available": True}
        return {"available": False, "reason": self.deployment.speculation_refusal or self.state_refusal,
                "requested": "deterministic requests are decoded without drafts (their lockstep.note says so); "
                             "other requests that name a method get a 400"}


def _load_audited(spec: str, weights: str, quantize: str | None, bits, group,
                  audit: str = "cached", phases: Phases | None = None, phase_prefix: str = "",
                  fuse: bool = False, defer=()) -> tuple:
    """(loaded model, audit report, transform); the audit stages in `defer` run only where
    their verdicts are cached (`AuditWork` runs the rest after serving starts)."""
    from lockstep.kernels.audit import audit_and_patch, audit_verdict_cache
    from lockstep.models.load import load_model
    from lockstep.models.quantize import quantize_model_in_memory

    phases = Phases() if phases is None else phases
    with phases.timed(phase_prefix + "load"):
        loaded = load_model(spec, weights="float32" if quantize else weights)
    transform = f"weights={loaded.weights}"
    if quantize:
        with phases.timed(phase_prefix + "quantize"):
            result = quantize_model_in_memory(loaded.model, None, quantize, bits, group)
        transform = f"quantize={result.spec.label()}"
    if fuse:  # before the audit: the fused layers' shapes are what it must check
        from lockstep.models.fused_projections import fuse_projections

        fused = fuse_projections(loaded.model)
        log.info("projections fused into %d layers", len(fused))
        transform += ";fused_projections"
    report = None
    if audit == "off":
        log.warning("%s", AUDIT_OFF_WARNING)
        transform += ";audit=off"
    else:
        with phases.timed(phase_prefix + "audit"):
            report = audit_and_patch(loaded.model, cache=audit_verdict_cache(),
                                     fresh=audit == "fresh", defer=defer)
    transform += workarounds_label(report)
    # Materialise everything quantization and workarounds left lazy: MLX streams belong to
    # the thread that made them, and the engine evaluates on its own worker thread.
    mx.eval(loaded.model.parameters())
    return loaded, report, transform


def workarounds_label(report) -> str:
    """The transform's part naming the audit's workarounds ("" where there are none)."""
    if report is None or not report.patched:
        return ""
    return ";workarounds=" + ",".join(f"{c.config.label()}:{c.verdict}" for c in report.patched)


def no_cheap_draft(options: Options) -> str:
    """Why `--draft-model default-quantized` has no form cheaper than the target on this
    backend ("": its affine 4-bit copy, cheaper where quantized kernels beat the target's).
    On the CPU none is: MLX's quantized kernels run slower there than float32 on OpenBLAS,
    and where the target is q4 itself (the bundled BLAS) a 4-bit copy costs as much."""
    if options.draft_model != "default-quantized" or mx.default_device().type == mx.DeviceType.gpu:
        return ""
    return ("--draft-model default-quantized: no draft cheaper than the target exists for this model on "
            "the CPU (MLX's 4-bit kernels run slower here than the target's own weights)")


def assess_draft(runtime: Runtime, options: Options) -> Deployment:
    """The deployment with its draft model's measured costs (server/engine/draft_costs.py): its
    per-token cost for adaptive speculation, its prompt chunk within the time budget, and
    whether drafting from it pays at all here (`draft_refusal` where it does not)."""
    from lockstep.server.engine.draft_costs import drafting_refusal, measure_draft_costs
    from lockstep.server.engine.model_runner import ModelRunner
    from lockstep.server.engine.speculative import measure_pass_costs

    deployment, model = runtime.deployment, runtime.loaded.model
    k_max = options.max_draft_tokens
    with runtime.timings.timed("draft_costs"):
        costs = measure_draft_costs(model, deployment.draft_model)
        pass_costs = deployment.pass_costs or tuple(measure_pass_costs(
            model, min(k_max, MEASURED_DRAFT_WIDTHS) + 1, repeats=2,
            runner=ModelRunner.as_engine_runs(model, deployment.kv_pool)))
    refusal = drafting_refusal(deployment.draft_name, costs, k_max, pass_costs)
    if refusal:
        log.warning("%s: requests asking for its drafts decode without them", refusal)
    else:
        log.info("draft model %s: a pass costs %.2f target passes; its prompt goes in chunks of at most %d tokens",
                 deployment.draft_name, costs.step_cost, costs.prefill_tokens())
    return dataclasses.replace(deployment, draft_refusal=refusal, draft_costs=costs, draft_step_cost=costs.step_cost,
                               draft_prefill_tokens=costs.prefill_tokens())


# Verification passes measured up to this many drafts for the decision (wider ones extend the
# table's slope): measuring every width up to --max-draft-tokens would lengthen startup.
MEASURED_DRAFT_WIDTHS = 4


def load_draft(options: Options, loaded, timings: Phases) -> tuple:
    """(draft model, its name): loaded, quantized (`default-quantized`: a 4-bit copy of the
    target) and audited like a served model. ValueError: it cannot draft for `loaded`."""
    if options.draft_model == "default-quantized":
        # a 4-bit copy of the target: cheap to make, and it agrees with it often
        draft_loaded, _, _ = _load_audited(options.model, "auto", "affine", 4, 32, options.audit, timings,
                                           phase_prefix="draft_")
        draft_name = f"{loaded.name} (affine 4-bit g32 copy)"
    else:
        draft_loaded, _, _ = _load_audited(options.draft_model, "auto", None, None, None, options.audit, timings,
                                           phase_prefix="draft_")
        draft_name = draft_loaded.name
        from lockstep.server.engine.speculative import draft_tokenizer_problem

        problem = draft_tokenizer_problem(loaded.tokenizer, draft_loaded.tokenizer)
        if problem:
            raise ValueError(f"--draft-model {options.draft_model}: {problem}; use a draft "
                             f"that shares {loaded.name}'s tokenizer")
    if not rewindable(draft_loaded.model):
        raise ValueError(f"--draft-model {options.draft_model}: its recurrent state cannot be rewound "
                         f"past rejected drafts; use a draft with plain KV caches")
    return draft_loaded.model, draft_name


def default_prefill_chunk() -> int:
    """`--prefill-chunk` where none is given: narrower on the CPU, where a deterministic
    prompt's chunk holds every other request for as long as it runs."""
    return CPU_PREFILL_CHUNK if mx.default_device().type == mx.DeviceType.cpu else PREFILL_CHUNK


def plain_prefill_chunk(prefill_chunk: int) -> int:
    """Tokens a plain prompt's chunk holds on this backend (0: the prefill chunk): smaller on
    the CPU, where a full chunk would hold every other request for seconds."""
    if mx.default_device().type == mx.DeviceType.cpu and prefill_chunk > CPU_PLAIN_PREFILL_CHUNK:
        return CPU_PLAIN_PREFILL_CHUNK
    return 0


def rewindable(model) -> bool:
    """Every layer's cache is a plain KV cache, which can be cut back after rejected drafts
    (and copied exactly by the prefix cache: server/engine/prefix_cache.py `storable`)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return all(type(c) is KVCache for c in make_prompt_cache(model))


def state_refusal(model) -> str | None:
    """Why this model's caches can be neither rewound past rejected drafts (no speculation)
    nor stored by the prefix cache (every prompt prefilled cold), or None when they can."""
    if rewindable(model):
        return None
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.invariance.cache_check import per_request_state

    state = per_request_state(make_prompt_cache(model))
    what = f"{state}: state rewritten in place" if state else "caches that are not all plain KV caches"
    return f"{what} can be neither rewound past rejected drafts nor stored by the prefix cache"


def build_runtime(options: Options, *, defer_guarantee: bool = False) -> Runtime:
    """The deployment `options` describe: the model loaded, quantized and audited, its
    guarantee proven (`GuaranteeWork`). With `defer_guarantee` (and L > 0) the proofs are left
    to the caller: `runtime.pending` is the work, `runtime.guarantee` says "proving" until it
    has run, and the deployment guarantees nothing meanwhile."""
    # mlx_lm (and with it transformers, ~2 s) is imported here, not at module level: the CLI
    # imports this module to build its parser, before `--cpu-blas` may re-exec the process.
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.invariance.selftest import ProofCache
    from lockstep.kernels.verdict_cache import VerdictCache
    from lockstep.server.fingerprint import weights_digest

    if options.speculative not in METHODS:
        raise ValueError(f"--speculative must be one of {METHODS}")
    if options.speculative == "draft" and not options.draft_model:
        raise ValueError("--speculative draft needs --draft-model")
    if options.num_draft_tokens is not None and options.num_draft_tokens < 1:
        raise ValueError("--num-draft-tokens must be >= 1")
    if options.max_draft_tokens < 1:
        raise ValueError("--max-draft-tokens must be >= 1")
    if options.num_draft_tokens is not None and options.num_draft_tokens > options.max_draft_tokens:
        raise ValueError(f"--num-draft-tokens {options.num_draft_tokens} is above --max-draft-tokens "
                         f"{options.max_draft_tokens}")
    if options.prefill_chunk is None:
        options = dataclasses.replace(options, prefill_chunk=default_prefill_chunk())
    if options.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be >= 1")
    if options.audit not in AUDIT_MODES:
        raise ValueError(f"--audit must be one of {AUDIT_MODES}")
    timings = Phases({"import": seconds_since_process_start()})
    if options.fuse_projections and options.prepare_model is not None:
        raise ValueError("--fuse-projections does not combine with distributed serving (its sharding "
                         "splits the separate projections)")
    from lockstep.kernels.audit.widths import NARROW, STAGES, AuditedRows

    # serve: the calls a first plain answer takes are audited now, the narrow ones (several
    # requests' rows, short prompt chunks) by the engine thread after serving starts
    defer = (NARROW,) if defer_guarantee and options.prepare_model is None else ()
    loaded, report, transform = _load_audited(options.model, options.weights, options.quantize,
                                              options.q_bits, options.q_group_size,
                                              options.audit, timings, fuse=options.fuse_projections,
                                              defer=defer)
    audited = AuditedRows(s for s in STAGES if report is None or s not in report.deferred)
    if options.prepare_model is not None:
        transform += ";" + options.prepare_model(loaded.model)

    # Speculation rewinds a request's caches past rejected drafts: recurrent state cannot be
    # rewound, and a sliding window cannot once it has wrapped. The prefix cache stores plain
    # KV only, for the same reason: such a model's prompts are always prefilled cold.
    refusal = state_refusal(loaded.model)
    speculation = refusal is None
    if not speculation:
        log.warning("speculative decoding is off%s and the prefix cache stores nothing for %s: %s",
                    " (--draft-model not loaded)" if options.draft_model else "", loaded.name, refusal)
    draft, draft_name = None, None
    no_draft = no_cheap_draft(options) if speculation and options.draft_where_it_pays else ""
    if no_draft:
        log.warning("%s: serving without a draft model", no_draft)
    defer_draft = bool(options.draft_model and speculation and defer_guarantee and not no_draft)
    if options.draft_model and speculation and not defer_draft and not no_draft:
        draft, draft_name = load_draft(options, loaded, timings)

    with timings.timed("fingerprint"):  # reads every weight file once (cached per process)
        digest = weights_digest(str(loaded.path))
    fresh_proofs = options.audit == "fresh" or not options.reuse_proofs
    proofs = ProofCache(VerdictCache("selftest"), fresh=fresh_proofs,
                        model_identity={"weights": digest, "transform": transform})
    from lockstep.kernels.custom import smoke_cache

    smoke_cache.prove_afresh(fresh_proofs)  # the custom kernels' smoke tests likewise

    from lockstep.kernels.batching.pool_mode import pool_mode

    kv_pool = pool_mode(loaded.model, options.kv_pool)
    if options.kv_pool != "off":
        log.info("KV pool: %s", kv_pool)
    limit = options.batch_invariant_limit
    settings = dict(speculation=speculation,
                    speculation_refusal=rewind_refusal(make_prompt_cache(loaded.model)) or "",
                    speculative=options.speculative,
                    num_draft_tokens=options.num_draft_tokens, max_draft_tokens=options.max_draft_tokens,
                    draft_model=draft, draft_name=draft_name, draft_loading=defer_draft, draft_refusal=no_draft,
                    prefill_chunk=options.prefill_chunk, adaptive_draft_tokens=options.adaptive_speculation,
                    plain_prefill_chunk=plain_prefill_chunk(options.prefill_chunk),
                    draft_backoff=options.draft_backoff,
                    kv_pool=kv_pool, async_eval_layers=options.async_eval_layers,
                    # a distributed model's passes hold its collectives: they are built op by op
                    compiled_passes=options.compiled_passes and options.prepare_model is None,
                    decode_ahead=options.decode_ahead, model_digest=digest)
    unproven = Guarantee(limit, strategy="native" if not limit else PENDING_STRATEGY,
                         reason="off (L = 0)" if not limit else "being proven")
    runtime = Runtime(loaded, Deployment(guarantee=unproven,
                                         fingerprint=_fingerprint(loaded, transform, unproven, options, kv_pool),
                                         **settings),
                      report, None, transform, timings, options.audit, refusal,
                      # deterministic requests wait for the audit too: their prompt chunks must not be cut
                      guarantee=GuaranteeState(PROVING if limit or not audited.complete else OFF),
                      audited=audited)
    work = GuaranteeWork(runtime, options, proofs)
    if not (defer_guarantee and limit):
        work.run()
        if audited.complete:  # else the audit's own work settles it (L = 0)
            work.settle()
    if draft is not None and options.draft_where_it_pays:  # measured with the forms the target serves with
        runtime.deployment = assess_draft(runtime, options)
    with timings.timed("warm_up"):  # the first request should not pay for first-call setup
        try:
            tokens = [1, 2, 3] if audited.allows(3) else [1]  # never a width not yet audited
            mx.eval(loaded.model(mx.array([tokens]), cache=make_prompt_cache(loaded.model)))
        except Exception as exc:  # e.g. a faulty kernel path the audit was told not to look for
            from lockstep.models.errors import ModelError

            hint = "; the kernel audit is off (--audit off)" if options.audit == "off" else ""
            raise ModelError(f"{loaded.path}: the warm-up forward pass failed "
                             f"({type(exc).__name__}: {exc}){hint}") from exc
    test = getattr(runtime.invariance, "self_test", None)
    runtime.serving_after_s = sum(timings.values())
    log.info("startup: %s; total %.1fs%s%s", timings.line(), sum(timings.values()),
             " (self-test proof re-used from the cache)" if test and test.cached else "",
             "; the guarantee is proven after serving starts" if not runtime.guarantee.settled else "")
    # the work left for the engine thread: the guarantee first (deterministic requests wait
    # for it), then the draft model (until it is loaded, requests decode without its drafts)
    work_left = (([AuditWork(runtime, options, proofs)] if not audited.complete else [])
                 + ([work] if limit and not runtime.guarantee.settled else [])
                 + ([DraftWork(runtime, options)] if defer_draft else []))
    runtime.pending = work_left or None
    return runtime


def _all_audited():
    from lockstep.kernels.audit.widths import AuditedRows

    return AuditedRows()


def _fingerprint(loaded, transform: str, guarantee: Guarantee, options: Options, kv_pool: str) -> str:
    from lockstep.kernels import cpu_blas
    from lockstep.server.fingerprint import system_fingerprint

    return system_fingerprint(loaded.path, transform=transform, strategy=guarantee.strategy, limit=guarantee.call_rows,
                              blas=cpu_blas.describe(), prefill_chunk=options.prefill_chunk, kv_pool=kv_pool)


@dataclass
class GuaranteeWork:
    """What proves a deployment's guarantee: the self-test (installing the proven forms), the
    kernel builds, the pass costs and the ragged proof; then the deployment that carries it.

    Run before serving (`build_runtime`), or by the engine thread after serving started
    (`serve`: plain passes run between the proofs' steps, kernels/proof_steps.py), so a fresh
    machine answers plain requests while it proves. Deterministic requests wait for it
    (server/engine/guarantee_state.py)."""

    runtime: Runtime
    options: Options
    proofs: object  # kernels.invariance.selftest.ProofCache
    # Set by the engine that runs this work: serve with a deployment from now on (engine thread).
    # A first ragged proof then puts the guarantee in force for the widths proven so far.
    install: Callable[[Deployment], None] | None = None

    def _proven_widths(self, invariance, pass_costs) -> Callable[[int], None]:
        """What a first ragged proof calls once passes of 1..w rows are proven: from w = L on, the
        guarantee is in force for deterministic passes of at most w rows (each width is proven on
        its own, so those stay proven whatever a wider one shows), its prompt chunks alone and its
        passes op by op until the shared-prefill and compiled proofs that follow."""
        runtime, options = self.runtime, self.options

        def proven(width: int) -> None:
            if self.install is None or width < invariance.limit or width % invariance.limit:
                return  # installed at multiples of L: each install retraces the compiled passes
            runtime.invariance = invariance
            guarantee = dataclasses.replace(Guarantee.installed(invariance), shared_passes=True, pass_rows=width)
            runtime.deployment = dataclasses.replace(
                runtime.deployment, guarantee=guarantee, pass_costs=pass_costs,
                fingerprint=_fingerprint(runtime.loaded, runtime.transform, guarantee, options,
                                         runtime.deployment.kv_pool))
            self.install(runtime.deployment)
            if not runtime.guarantee.settled:
                runtime.guarantee.settle(settled_state(runtime.deployment))
            log.info("guarantee in force for passes of 1..%d rows; the ragged proof goes on", width)
        return proven

    def run(self) -> Deployment:
        from lockstep.kernels.batching.ragged_selftest import per_request_self_test
        from lockstep.kernels.invariance import set_batch_invariant_limit
        from lockstep.server.engine.guarantee import decide_guarantee

        runtime, options, timings = self.runtime, self.options, self.runtime.timings
        model, kv_pool = runtime.loaded.model, runtime.deployment.kv_pool
        if options.batch_invariant_limit and not runtime.audited.complete:
            # the proofs call the layers at every width up to L
            raise RuntimeError("the kernel audit passed only calls of "
                               f"{runtime.audited.describe()['audited_rows']} rows")
        started = time.perf_counter()
        with timings.timed("self_test"):
            invariance = set_batch_invariant_limit(model, options.batch_invariant_limit,
                                             options.invariant_strategy, proof_cache=self.proofs,
                                             per_request_proof=per_request_self_test)
        if options.batch_invariant_limit:
            (log.info if invariance.guaranteed else log.warning)(
                "batch invariance L=%d strategy=%s guaranteed=%s (%s)",
                invariance.limit, invariance.strategy, invariance.guaranteed, invariance.reason)
        if invariance.guaranteed:
            from lockstep.kernels.invariance.warmup import build_kernels

            with timings.timed("build_kernels"):  # compiled now, not during the first passes
                build_kernels(model, invariance.limit)
        pass_costs = None
        if options.adaptive_speculation and runtime.deployment.speculation:
            from lockstep.server.engine.model_runner import ModelRunner
            from lockstep.server.engine.speculative import measure_pass_costs

            widest = options.max_draft_tokens + 1
            if invariance.guaranteed:
                widest = max(widest, invariance.limit)
            with timings.timed("pass_costs"):  # what a verification pass of w rows costs in the engine
                pass_costs = tuple(measure_pass_costs(model, widest,
                                                      runner=ModelRunner.as_engine_runs(model, kv_pool)))
        # the deployment's guarantee, decided here only (its ragged proof timed where one is made)
        with timings.timed("ragged_proof") if invariance.guaranteed else contextlib.nullcontext():
            guarantee = decide_guarantee(model, invariance, kv_pool, self.proofs, options.max_batch_rows,
                                         shared_prefill=options.prepare_model is None,
                                         compiled=runtime.deployment.compiled_passes,
                                         on_width=self._proven_widths(invariance, pass_costs))
        deployment = dataclasses.replace(
            runtime.deployment, guarantee=guarantee, pass_costs=pass_costs,
            fingerprint=_fingerprint(runtime.loaded, runtime.transform, guarantee, options, kv_pool))
        runtime.invariance, runtime.deployment = invariance, deployment
        runtime.guarantee_seconds = time.perf_counter() - started
        return deployment

    def settle(self) -> None:
        """Say the proofs' outcome to whoever waits for it: once the deployment that carries it
        is the one requests are planned with."""
        guarantee, timings = self.runtime.deployment.guarantee, self.runtime.timings
        self.runtime.guarantee.settle(settled_state(self.runtime.deployment),
                                      "" if guarantee.guaranteed else guarantee.reason)
        if self.runtime.guarantee_seconds is not None and guarantee.call_rows:
            proofs = Phases({k: v for k, v in timings.items() if k in PROOF_PHASES})
            proofs.compile = {k: v for k, v in timings.compile.items() if k in PROOF_PHASES}
            log.info("guarantee %s after %.1fs of proofs: %s", self.runtime.guarantee.state.replace("_", " "),
                     self.runtime.guarantee_seconds, proofs.line())


PROOF_PHASES = ("self_test", "build_kernels", "pass_costs", "ragged_proof")


@dataclass
class AuditWork:
    """The kernel audit's stages left when serving started (kernels/audit/widths.py: calls of
    2..32 rows), run by the engine thread between passes before the guarantee's proofs (they
    call the layers at those widths). Each configuration's workaround is swapped in as soon as
    its verdict is in, before any pass runs; the widths become audited (the scheduler's gate)
    only once every configuration passed them. A refusal leaves them unaudited: serving goes
    on at the audited widths, and the guarantee is refused."""

    runtime: Runtime
    options: Options
    proofs: object  # kernels.invariance.selftest.ProofCache: its model identity names the workarounds

    def run(self) -> Deployment:
        from lockstep.kernels.audit import audit_model, audit_verdict_cache, merge_reports, patch_config
        from lockstep.kernels.audit.report import OK, REFUSED as REFUSED_VERDICT

        runtime = self.runtime
        model, first = runtime.loaded.model, runtime.audit
        self.stages = first.deferred

        def patch(result, layers) -> None:
            if result.verdict not in (OK, REFUSED_VERDICT):
                patch_config(model, result.config, layers, result.verdict)
                mx.eval(model.parameters())

        with runtime.timings.timed("audit_after_start"):
            later = audit_model(model, cache=audit_verdict_cache(), fresh=self.options.audit == "fresh",
                                stages=first.deferred, on_result=patch)
        report = merge_reports(first, later)
        if report.refused:
            report.deferred = first.deferred
            log.error("kernel audit: %s; serving goes on with calls of %s rows only",
                      "; ".join(f"{c.config.label()} refused" for c in report.refused),
                      runtime.audited.describe()["audited_rows"])
        transform = runtime.transform
        old, new = workarounds_label(first), workarounds_label(report)
        transform = transform.replace(old, new) if old else transform + new
        runtime.audit, runtime.transform = report, transform
        self.proofs.model_identity["transform"] = transform
        runtime.deployment = dataclasses.replace(runtime.deployment, fingerprint=_fingerprint(
            runtime.loaded, transform, runtime.deployment.guarantee, self.options, runtime.deployment.kv_pool))
        return runtime.deployment

    def settle(self) -> None:
        runtime = self.runtime
        if runtime.audit.refused:
            if not self.options.batch_invariant_limit:
                runtime.guarantee.settle(REFUSED, "the kernel audit refused calls of several rows")
            return
        for stage in self.stages:
            runtime.audited.add(stage)
        log.info("kernel audit complete (%.1fs on the engine thread after serving started): "
                 "calls of every width audited", runtime.timings.get("audit_after_start", 0.0))
        if not self.options.batch_invariant_limit:
            runtime.guarantee.settle(settled_state(runtime.deployment))


@dataclass
class DraftWork:
    """Loading the draft model (load, quantize, audit) after serving started: the engine runs it
    after the guarantee's proofs, serving between the audit's configurations. Until it is done,
    requests that would draft from it decode without drafts (the same tokens for deterministic
    requests: drafts change the speed only)."""

    runtime: Runtime
    options: Options

    def run(self) -> Deployment:
        runtime = self.runtime
        try:
            draft, name = load_draft(self.options, runtime.loaded, runtime.timings)
            runtime.deployment = dataclasses.replace(runtime.deployment, draft_model=draft, draft_name=name)
            if self.options.draft_where_it_pays:
                runtime.deployment = assess_draft(runtime, self.options)
            deployment = dataclasses.replace(runtime.deployment, draft_loading=False)
        except Exception as exc:  # a draft that cannot draft: serving goes on without one
            log.error("--draft-model %s not loaded: %s", self.options.draft_model, exc)
            deployment = dataclasses.replace(runtime.deployment, draft_loading=False,
                                             draft_problem=f"{type(exc).__name__}: {exc}")
        runtime.deployment = deployment
        return deployment

    def settle(self) -> None:
        if self.runtime.deployment.draft_model is not None and not self.runtime.deployment.draft_refusal:
            log.info("draft model %s loaded: requests draft from it", self.runtime.deployment.draft_name)
