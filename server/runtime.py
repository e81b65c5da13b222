"""Assemble what a deployment serves: model → quantize → kernel audit → batch invariance.

Shared by `lockstep serve`, `verify` and `bench`, so every command runs the model exactly
as the server would. No HTTP here (the device runs this without fastapi).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from server.decoding import MAX_DRAFT_TOKENS, METHODS, Deployment

log = logging.getLogger("lockstep.runtime")

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
    num_draft_tokens: int = 4
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    draft_model: str | None = None  # a model spec, or "default-quantized"
    prefill_chunk: int = 512


@dataclass
class Runtime:
    loaded: object  # models.load.LoadedModel
    deployment: Deployment
    audit: object  # kernels.audit_report.AuditReport
    plan: object  # kernels.invariant.InvariancePlan
    transform: str
    timings: dict = field(default_factory=dict)

    def model_info(self) -> dict:
        """Per-model details for GET /v1/models."""
        from kernels.audit import summary

        return {
            "audit": summary(self.audit),
            "batch_invariance": {
                "limit": self.plan.limit, "strategy": self.plan.strategy,
                "guaranteed": self.plan.guaranteed, "reason": self.plan.reason,
            },
            "transform": self.transform,
            "draft_model": self.deployment.draft_name,
        }


def _load_audited(spec: str, weights: str, quantize: str | None, bits, group) -> tuple:
    from kernels.audit import audit_and_patch
    from models.load import load_model
    from models.quantize import quantize_model_in_memory

    loaded = load_model(spec, weights="float32" if quantize else weights)
    transform = f"weights={loaded.weights}"
    if quantize:
        result = quantize_model_in_memory(loaded.model, None, quantize, bits, group)
        transform = f"quantize={result.spec.label()}"
    report = audit_and_patch(loaded.model)
    if report.patched:
        transform += ";workarounds=" + ",".join(f"{c.config.label()}:{c.verdict}" for c in report.patched)
    # Materialise everything quantization and workarounds left lazy: MLX streams belong to
    # the thread that made them, and the engine evaluates on its own worker thread.
    mx.eval(loaded.model.parameters())
    return loaded, report, transform


def build_runtime(options: Options) -> Runtime:
    from kernels import cpu_blas
    from kernels.invariant import cache_invariance_problem, set_batch_invariant_limit
    from server.fingerprint import system_fingerprint

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
    if options.prefill_chunk < 1:
        raise ValueError("--prefill-chunk must be >= 1")
    timings = {}
    start = time.perf_counter()
    loaded, report, transform = _load_audited(options.model, options.weights, options.quantize,
                                              options.q_bits, options.q_group_size)
    timings["load_and_audit_s"] = time.perf_counter() - start

    draft, draft_name = None, None
    if options.draft_model:
        if options.draft_model == "default-quantized":
            # a 4-bit copy of the target: cheap to make, and it agrees with it often
            draft_loaded, _, _ = _load_audited(options.model, "auto", "affine", 4, 32)
            draft_name = f"{loaded.name} (affine 4-bit g32 copy)"
        else:
            draft_loaded, _, _ = _load_audited(options.draft_model, "auto", None, None, None)
            draft_name = draft_loaded.name
        draft = draft_loaded.model

    start = time.perf_counter()
    plan = set_batch_invariant_limit(loaded.model, options.batch_invariant_limit,
                                     options.invariant_strategy)
    timings["self_test_s"] = time.perf_counter() - start
    guaranteed = plan.guaranteed
    problem = cache_invariance_problem(make_prompt_cache(loaded.model))
    if options.batch_invariant_limit and problem:
        guaranteed = False
        log.warning("batch invariance refused: %s", problem)
    if options.batch_invariant_limit:
        (log.info if guaranteed else log.warning)(
            "batch invariance L=%d strategy=%s guaranteed=%s (%s)",
            plan.limit, plan.strategy, guaranteed, plan.reason)

    fingerprint = system_fingerprint(loaded.path, transform=transform, strategy=plan.strategy,
                                     limit=plan.limit, blas=cpu_blas.describe(),
                                     prefill_chunk=options.prefill_chunk)
    deployment = Deployment(
        limit=plan.limit, guaranteed=guaranteed, strategy=plan.strategy,
        speculative=options.speculative, num_draft_tokens=options.num_draft_tokens,
        max_draft_tokens=options.max_draft_tokens, draft_model=draft, draft_name=draft_name, prefill_chunk=options.prefill_chunk,
        fingerprint=fingerprint,
    )
    return Runtime(loaded, deployment, report, plan, transform, timings)
