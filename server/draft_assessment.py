"""Whether a draft model pays here: the cheap draft that does not exist on this backend, and
a loaded draft's measured costs against the target (server/engine/decoding/draft_costs.py)."""
from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx

from lockstep.server.engine.guarantee.deployment import Deployment

log = logging.getLogger("lockstep.runtime")


def no_cheap_draft(options) -> str:
    """Why `--draft-model default-quantized` has no form cheaper than the target on this
    backend ("": its affine 4-bit copy, cheaper where quantized kernels beat the target's).
    On the CPU none is: MLX's quantized kernels run slower there than float32 on OpenBLAS,
    and where the target is q4 itself (the bundled BLAS) a 4-bit copy costs as much."""
    if options.draft_model != "default-quantized" or mx.default_device().type == mx.DeviceType.gpu:
        return ""
    return ("--draft-model default-quantized: no draft cheaper than the target exists for this model on "
            "the CPU (MLX's 4-bit kernels run slower here than the target's own weights)")


def assess_draft(runtime, options) -> Deployment:
    """The deployment with its draft model's measured costs (server/engine/decoding/draft_costs.py): its
    per-token cost for adaptive speculation, its prompt chunk within the time budget, and
    whether drafting from it pays at all here (`draft_refusal` where it does not). `runtime`,
    `options`: server/runtime.py's `Runtime` and `Options`."""
    from lockstep.server.engine.decoding.draft_costs import drafting_refusal, measure_draft_costs
    from lockstep.server.engine.runner.model_runner import ModelRunner
    from lockstep.server.engine.decoding.speculative import measure_pass_costs

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
