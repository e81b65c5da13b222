"""What a deployment guarantees, decided once, at startup, and nowhere else.

Two facts, both from proofs made on the running backend:
- the rows one forward pass may hold with every row bit-identical to its single-row call:
  L once the self-test (kernels/invariance/selftest.py) proved the installed forms, else 0;
- whether rows of *different* requests may share such a pass: the ragged proof
  (kernels/batching/ragged_selftest.py), made here only, over the KV layout the engine uses;
- whether deterministic requests' prompt chunks (of at least `shared_chunk_rows(L)` rows) may
  share a pass: the shared-prefill proof (kernels/batching/shared_prefill_proof.py), made
  after the ragged one;
- whether deterministic decode passes may run compiled (kernels/batching/compiled_pass.py):
  the ragged proof once more, its passes compiled, where the deployment compiles passes.

A model with per-request state (a recurrent, conv or sliding-window cache) is proven for one
row per request (`InstalledInvariance.request_rows` = 1): its deterministic requests share
decode passes of at most L rows, one row each, and never speculate (k = 0); its state is
neither rewound nor stored in the prefix cache.

The result goes into the `Deployment` (server/engine/deployment.py); `plan_request` turns it
into each request's plan, and the engine reads nothing else.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Guarantee:
    rows: int  # rows one kernel call may hold with the guarantee: L (0: none)
    shared_passes: bool  # requests' deterministic rows may share a pass
    reason: str = ""
    pass_rows: int = 0  # the widest pass proven to hold deterministic rows of several requests
    shared_prefill_rows: int = 0  # deterministic prompt chunks of this many rows may share a pass (0: none)
    compiled_passes: bool = False  # deterministic decode passes may run compiled


def decide_guarantee(model, plan, kv_pool: str = "off", proofs=None, pass_rows: int | None = None,
                     shared_prefill: bool = True, compiled: bool = False, on_width=None) -> Guarantee:
    """The deployment's guarantee for `model` with the installed invariance `plan`
    (a kernels.invariance.limit.InstalledInvariance or None); `proofs` a ProofCache to re-use
    a ragged proof made earlier on this machine. `pass_rows`: the widest pass the engine will
    build (`--max-batch-rows`): L bounds one kernel call, not a pass, so the ragged proof covers
    every width up to it (calls of more than L rows run in blocks of at most L); if that fails,
    passes of at most L rows are proven instead. `shared_prefill` False: no shared-prefill
    proof, deterministic prompt chunks run alone (a distributed deployment: its pipeline
    hands a prompt chunk on through a KV cache, which a ragged pass does not have). `compiled`:
    the deployment compiles its plain passes over the pool's kernel; deterministic ones then
    too where the ragged proof holds for compiled passes of every width proven. `on_width(w)`:
    called while a first ragged proof goes, once passes of 1..w rows are proven."""
    if plan is None or not plan.guaranteed:
        return Guarantee(0, False, plan.reason if plan is not None else "no batch-invariant limit")
    from lockstep.kernels.batching.ragged import enable_ragged, ragged_problem
    from lockstep.kernels.batching.ragged_selftest import prove_ragged_cached

    problem = ragged_problem(model)
    if problem is not None:
        log.warning("requests are not batched into shared passes (%s): deterministic requests get "
                    "passes of their own", problem)
        return Guarantee(plan.limit, False, problem)
    enable_ragged(model)
    widest = max(plan.limit, pass_rows or plan.limit)
    proof = prove_ragged_cached(model, plan.limit, proofs, kv_pool=kv_pool, pass_rows=widest, on_width=on_width)
    if not proof and widest > plan.limit:
        log.warning("ragged passes of up to %d rows not proven (%s): trying passes of at most L = %d",
                    widest, proof.reason, plan.limit)
        widest = plan.limit
        proof = prove_ragged_cached(model, plan.limit, proofs, kv_pool=kv_pool, pass_rows=widest)
    if not proof:
        log.warning("ragged passes not proven (%s): deterministic requests get passes of their own",
                    proof.reason)
        return Guarantee(plan.limit, False, proof.reason, 0)
    log.info("ragged passes of 1..%d rows proven bit-identical to solo passes (%.1f s)",
             widest, proof.seconds)
    return Guarantee(plan.limit, True, proof.reason, widest,
                     _shared_prefill(model, plan.limit, kv_pool, proofs) if shared_prefill else 0,
                     compiled and kv_pool == "kernel" and _compiled(model, plan.limit, proofs, widest))


def _compiled(model, limit: int, proofs, widest: int) -> bool:
    """Whether compiled passes of 1..widest rows give every row its solo pass's bits."""
    from lockstep.kernels.batching.ragged_selftest import prove_ragged_cached

    proof = prove_ragged_cached(model, limit, proofs, kv_pool="kernel", pass_rows=widest, compiled=True)
    if proof:
        log.info("compiled passes of 1..%d rows proven bit-identical to solo passes (%.1f s)", widest, proof.seconds)
    else:
        log.warning("deterministic decode passes are built op by op: %s", proof.reason)
    return proof.passed


def _shared_prefill(model, limit: int, kv_pool: str, proofs) -> int:
    """The fewest rows a deterministic prompt chunk needs to share a prefill pass (0: none may;
    always 0 for a model with per-request state, whose prompt chunks run alone)."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.batching.shared_prefill_proof import prove_shared_prefill_cached, shared_chunk_rows
    from lockstep.kernels.invariance.cache_check import per_request_state

    if per_request_state(make_prompt_cache(model)) is not None:
        return 0
    rows = shared_chunk_rows(limit)
    proof = prove_shared_prefill_cached(model, limit, proofs, kv_pool=kv_pool)
    if proof:
        log.info("prompt chunks of %d rows or more proven to keep their KV in shared passes (%.1f s)",
                 rows, proof.seconds)
        return rows
    log.info("deterministic prompt chunks are prefilled in passes of their own: %s", proof.reason)
    return 0


def proven_deployment(model, plan, *, kv_pool: str = "off", proofs=None, pass_rows: int | None = None,
                      **settings):
    """A `Deployment` for `model` whose guarantee is `decide_guarantee`'s (the ragged proof made
    here); `settings`: the Deployment's other fields. A model with per-request state gets no
    speculation, whatever `settings` say (its state cannot be rewound past rejected drafts)."""
    from mlx_lm.models.cache import make_prompt_cache

    from lockstep.kernels.invariance.cache_check import per_request_state
    from lockstep.server.engine.deployment import Deployment, rewind_refusal

    guarantee = decide_guarantee(model, plan, kv_pool, proofs, pass_rows,
                                 compiled=settings.get("compiled_passes", Deployment.compiled_passes))
    caches = make_prompt_cache(model)
    if per_request_state(caches) is not None:
        settings["speculation"] = False
        settings["speculation_refusal"] = rewind_refusal(caches)
    return Deployment(limit=plan.limit if plan is not None else 0, guaranteed_rows=guarantee.rows,
                      shared_passes=guarantee.shared_passes, shared_pass_rows=guarantee.pass_rows,
                      shared_prefill_rows=guarantee.shared_prefill_rows,
                      compiled_canonical_passes=guarantee.compiled_passes,
                      strategy=plan.strategy if plan is not None else "native", kv_pool=kv_pool, **settings)
