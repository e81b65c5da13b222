"""Loading a model as it is served: load → quantize → fuse → kernel audit (its workarounds
patched in), and a draft model likewise, checked against the target it drafts for."""
from __future__ import annotations

import logging

import mlx.core as mx

from lockstep.server.phases import Phases

log = logging.getLogger("lockstep.runtime")

AUDIT_OFF_WARNING = ("quantized kernels NOT audited (--audit off): a faulty kernel path "
                     "would go unnoticed")


def load_served(spec: str, weights: str, quantize: str | None, bits, group, phases: Phases | None = None,
                phase_prefix: str = "", after_load=None) -> tuple:
    """(loaded model, transform): `spec` loaded, quantized and cast to the dtype it computes in
    on this backend, as `serve` runs it (before any fusing and the audit). `after_load` (the
    loaded model) is called before the quantization."""
    from lockstep.models import activation_dtype
    from lockstep.models.load import load_model
    from lockstep.models.quantize import quantize_model_in_memory

    phases = Phases() if phases is None else phases
    with phases.timed(phase_prefix + "load"):
        loaded = load_model(spec, weights="float32" if quantize else weights)
    if after_load is not None:
        after_load(loaded)
    transform = f"weights={loaded.weights}"
    if quantize:
        with phases.timed(phase_prefix + "quantize"):
            result = quantize_model_in_memory(loaded.model, None, quantize, bits, group)
        transform = f"quantize={result.spec.label()}"
    dtype = activation_dtype.apply(loaded.model, spec, weights)
    if dtype is not None:
        log.info("%s: the import's float32 parameters run as %s on this GPU", loaded.name, dtype)
        transform += f";{str(dtype).removeprefix('mlx.core.')}"
    elif note := activation_dtype.float32_note(loaded.model):
        log.warning("%s: %s", loaded.name, note)
    return loaded, transform


def load_audited(spec: str, weights: str, quantize: str | None, bits, group,
                  audit: str = "cached", phases: Phases | None = None, phase_prefix: str = "",
                 fuse: bool = False, defer=(), after_load=None, before_audit=None) -> tuple:
    """(loaded model, audit report, transform); the audit stages in `defer` run only where
    their verdicts are cached (`AuditWork` runs the rest after serving starts). `after_load`
    (the loaded model) is called before the quantization and the audit, `before_audit` after
    them both (the model as served)."""
    from lockstep.kernels.audit import audit_and_patch, audit_verdict_cache

    phases = Phases() if phases is None else phases
    loaded, transform = load_served(spec, weights, quantize, bits, group, phases, phase_prefix, after_load)
    if fuse:  # before the audit: the fused layers' shapes are what it must check
        from lockstep.models.fused_projections import fuse_projections

        fused = fuse_projections(loaded.model)
        log.info("projections fused into %d layers", len(fused))
        transform += ";fused_projections"
    if before_audit is not None:
        before_audit(loaded)
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


def load_draft(options, loaded, timings: Phases, defer=()) -> tuple:
    """(draft model, its name, its audit report or None): loaded, quantized (`default-quantized`:
    a 4-bit copy of the target) and audited like a served model, the audit stages in `defer`
    only where their verdicts are cached (`report.deferred`: the rest, for the caller to audit
    before it drafts). ValueError: it cannot draft for `loaded`."""
    if options.draft_model == "default-quantized":
        # a 4-bit copy of the target: cheap to make, and it agrees with it often
        draft_loaded, report, _ = load_audited(options.model, "auto", "affine", 4, 32, options.audit, timings,
                                               phase_prefix="draft_", defer=defer)
        draft_name = f"{loaded.name} (affine 4-bit g32 copy)"
    else:
        draft_loaded, report, _ = load_audited(options.draft_model, "auto", None, None, None, options.audit,
                                               timings, phase_prefix="draft_", defer=defer)
        draft_name = draft_loaded.name
        from lockstep.server.engine.decoding.drafters import draft_tokenizer_problem

        problem = draft_tokenizer_problem(loaded.tokenizer, draft_loaded.tokenizer)
        if problem:
            raise ValueError(f"--draft-model {options.draft_model}: {problem}; use a draft "
                             f"that shares {loaded.name}'s tokenizer")
    if not rewindable(draft_loaded.model):
        raise ValueError(f"--draft-model {options.draft_model}: its recurrent state cannot be rewound "
                         f"past rejected drafts; use a draft with plain KV caches")
    return draft_loaded.model, draft_name, report


def rewindable(model) -> bool:
    """Every layer's cache is a plain KV cache, which can be cut back after rejected drafts
    (and copied exactly by the prefix cache: server/engine/cache/prefix_cache.py `storable`)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return all(type(c) is KVCache for c in make_prompt_cache(model))
