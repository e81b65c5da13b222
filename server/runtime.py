"""Assemble what a deployment serves: model → quantize → kernel audit → batch invariance.

Shared by `lockstep serve`, `verify` and `bench`, so every command runs the model exactly
as the server would. No HTTP here (the device runs this without fastapi).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from lockstep.server import draft_assessment, model_loading
from lockstep.server import warm_ahead as warm
from lockstep.server.engine.guarantee.decode_plan import METHODS
from lockstep.server.engine.guarantee.deployment import (CPU_PLAIN_PREFILL_CHUNK, CPU_PREFILL_CHUNK, MAX_DRAFT_TOKENS,
                                                         PREFILL_CHUNK, Deployment, rewind_refusal)
from lockstep.server.engine.guarantee.guarantee import PENDING_STRATEGY, Guarantee
from lockstep.server.engine.guarantee.guarantee_state import OFF, PROVING, GuaranteeState
from lockstep.server.model_loading import AUDIT_OFF_WARNING, load_draft, rewindable
from lockstep.server.options import (AUDIT_MODES, DEFAULT_MAX_BATCH_ROWS, DEFAULT_NUM_DRAFT_TOKENS,
                                     DEFAULT_PREFILL_CHUNK)
from lockstep.server.phases import Phases
from lockstep.server.startup_work import AuditWork, DraftWork, GuaranteeWork, SamplingWork, deployment_fingerprint

log = logging.getLogger("lockstep.runtime")

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
    # The next compiled decode pass built while the device runs this one (server/engine/runner/decode_ahead.py).
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
    admission: object = None  # server.engine.scheduling.admission.Admission the engine serves with (serve only)
    # (vocabulary, dtype) of the model's logits, seen at the warm-up: what the batched-sampling
    # proof samples (SamplingWork)
    logits_format: tuple | None = None
    # the children compiling the deferred audit stages' kernels (kernels/audit/compile_ahead.py)
    compile_ahead: object = None

    def set_admission(self, admission) -> None:
        """Serve with `admission` (server/engine/scheduling/admission.py): its pass width is the widest the
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
        and what a request that asks for it gets (server/engine/guarantee/decode_plan.py)."""
        if self.deployment.speculation:
            return {"available": True}
        return {"available": False, "reason": self.deployment.speculation_refusal or self.state_refusal,
                "requested": "deterministic requests are decoded without drafts (their lockstep.note says so); "
                             "other requests that name a method get a 400"}


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
    from lockstep.server.weights_digest import weights_digest_soon

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
    from lockstep.kernels.audit import compile_ahead as ahead
    from lockstep.kernels.audit.widths import STAGES, AuditedRows, deferred_stages
    from lockstep.kernels.backend_kind import backend_kind

    # serve: the calls a first plain answer takes are audited now, the others (several requests'
    # rows, short prompt chunks; on CUDA wide ones too) by the engine thread after serving starts
    backend = backend_kind()
    digest_of = []  # the weights' digest, hashed on a thread while the model is audited

    def hash_weights(loaded) -> None:
        digest_of.append(weights_digest_soon(str(loaded.path)))

    warm_ahead = []  # the children compiling a first answer's kernels (server/warm_ahead.py)

    def compile_first_answer_ahead(loaded) -> None:
        jobs = warm.recipes(loaded.model)
        if warm.WarmAhead.needed(jobs):
            warm_ahead.append(warm.WarmAhead.start(jobs))
            with timings.timed("lookups_compiled_ahead"):  # before the audit takes them
                warm_ahead[0].wait(warm.LOOKUPS)
    defer = deferred_stages(backend) if defer_guarantee and options.prepare_model is None else ()
    loaded, report, transform = model_loading.load_audited(
        options.model, options.weights, options.quantize, options.q_bits, options.q_group_size,
        options.audit, timings, fuse=options.fuse_projections, defer=defer, after_load=hash_weights,
        before_audit=compile_first_answer_ahead if ahead.pays(backend) and options.prepare_model is None else None)
    audited = AuditedRows(s for s in STAGES if report is None or s not in report.deferred)
    compile_ahead = (ahead.CompileAhead.for_report(loaded.model, report)
                     if report is not None and ahead.pays(backend) else None)
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
    no_draft = draft_assessment.no_cheap_draft(options) if speculation and options.draft_where_it_pays else ""
    if no_draft:
        log.warning("%s: serving without a draft model", no_draft)
    defer_draft = bool(options.draft_model and speculation and defer_guarantee and not no_draft)
    if options.draft_model and speculation and not defer_draft and not no_draft:
        draft, draft_name, _ = load_draft(options, loaded, timings)

    with timings.timed("fingerprint"):  # what is left of it: it read the weight files during the audit
        digest = digest_of[0]()
    fresh_proofs = options.audit == "fresh" or not options.reuse_proofs
    proofs = ProofCache(VerdictCache("selftest"), fresh=fresh_proofs,
                        model_identity={"weights": digest, "transform": transform})
    from lockstep.kernels.custom import smoke_cache

    smoke_cache.prove_afresh(fresh_proofs)  # the custom kernels' smoke tests likewise

    from lockstep.kernels.batching.pool_mode import pool_mode
    from lockstep.kernels.custom.split_rows import prompt_chunks_native

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
                    plain_prompt_native=bool(limit) and prompt_chunks_native(loaded.model, options.prefill_chunk),
                    draft_backoff=options.draft_backoff,
                    kv_pool=kv_pool, async_eval_layers=options.async_eval_layers,
                    # a distributed model's passes hold its collectives: they are built op by op
                    compiled_passes=options.compiled_passes and options.prepare_model is None,
                    decode_ahead=options.decode_ahead, model_digest=digest)
    unproven = Guarantee(limit, strategy="native" if not limit else PENDING_STRATEGY,
                         reason="off (L = 0)" if not limit else "being proven")
    runtime = Runtime(loaded, Deployment(guarantee=unproven,
                                         fingerprint=deployment_fingerprint(loaded, transform, unproven, options, kv_pool),
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
        runtime.deployment = draft_assessment.assess_draft(runtime, options)
    with timings.timed("warm_up"):  # the first request should not pay for first-call setup
        if warm_ahead:  # its kernels compiled meanwhile (server/warm_ahead.py)
            warm_ahead[0].wait(warm.ACTIVATION)
        try:
            tokens = [1, 2, 3] if audited.allows(3) else [1]  # never a width not yet audited
            logits = loaded.model(mx.array([tokens]), cache=make_prompt_cache(loaded.model))
            mx.eval(logits)
            runtime.logits_format = (logits.shape[-1], logits.dtype)
        except Exception as exc:  # e.g. a faulty kernel path the audit was told not to look for
            from lockstep.models.errors import ModelError

            hint = "; the kernel audit is off (--audit off)" if options.audit == "off" else ""
            raise ModelError(f"{loaded.path}: the warm-up forward pass failed "
                             f"({type(exc).__name__}: {exc}){hint}") from exc
        if warm_ahead:  # the rest: the engine's row writes, the first request's compiled pass
            warm_ahead[0].wait_all()
            warm_ahead[0].close()  # a child later than that is never published: stopped, its directory removed
    sampling = SamplingWork(runtime, proofs)
    if not (defer_guarantee and limit):
        sampling.run()
        sampling.settle()
    test = getattr(runtime.invariance, "self_test", None)
    runtime.serving_after_s = sum(timings.values())
    log.info("startup: %s; total %.1fs%s%s", timings.line(), sum(timings.values()),
             " (self-test proof re-used from the cache)" if test and test.cached else "",
             "; the guarantee is proven after serving starts" if not runtime.guarantee.settled else "")
    # the work left for the engine thread: the audit's deferred stages, the guarantee
    # (deterministic requests wait for both), then the draft model (until it is loaded, requests decode without its drafts),
    # then the batched-sampling proof (until it has run, deterministic rows sample alone)
    runtime.compile_ahead = compile_ahead
    work_left = ([AuditWork(runtime, options, proofs, stage) for stage in (report.deferred if report else ())]
                 + ([work] if limit and not runtime.guarantee.settled else [])
                 + ([DraftWork(runtime, options)] if defer_draft else [])
                 + ([sampling] if defer_guarantee and limit else []))
    runtime.pending = work_left or None
    return runtime


def _all_audited():
    from lockstep.kernels.audit.widths import AuditedRows

    return AuditedRows()
