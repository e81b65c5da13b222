"""What a distributed start-up adds to `lockstep serve` (`--parallel tensor|pipeline` under
`mlx.launch`, one process per rank): its flags, and the steps only ranks take.

The start-up itself is the serve command's (server/commands/serve.py, `run_rank`), on every rank:
1. join the world (connect timeout), rank 0 binds the HTTP port (a busy port is reported by
   every rank), and the ranks compare lockstep/MLX versions and settings (`check_startup`);
2. the one serve assembly with this rank's world: the model sharded for this rank
   (`rank_options`, sharding.py), fresh proofs that every rank agrees on (proofs.py); the
   ranks then compare the outcome (weights, strategy, L, guarantee) and take rank 0's KV
   budget and measured pass costs (`agreed_deployment`);
3. the `ReplicatedEngine` runs. Rank 0 serves HTTP (only it binds a port; every route answers
   503 once the deployment failed: `gate_on_health`); the others run the engine until rank 0
   broadcasts stop (exit 0) or the deployment fails (exit 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import pickle

from lockstep.server.options import (DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_RANK_TIMEOUT_S, DEFAULT_STARTUP_TIMEOUT_S,
                                     DISTRIBUTED_BACKENDS, PARALLEL_CHOICES)

FAILED_GRACE_S = 2.0  # rank 0 answers 503 and ends the streams this long before exiting


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("distributed (run under mlx.launch; docs/DISTRIBUTED.md)")
    group.add_argument("--parallel", choices=PARALLEL_CHOICES, default=None,
                       help="split the model over the ranks of an mlx.launch: tensor (every layer's "
                            "heads and MLP split, mlx-lm shard()) or pipeline (layers split). Rank 0 "
                            "serves HTTP; answers are reproducible per topology (docs/DETERMINISM.md)")
    group.add_argument("--distributed-backend", choices=DISTRIBUTED_BACKENDS, default="any",
                       help="mlx.distributed backend (default any: the one mlx.launch prepared)")
    group.add_argument("--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT_S,
                       help=f"while serving, seconds without a completed collective before a rank "
                            f"declares the deployment dead and exits 1 (default {DEFAULT_RANK_TIMEOUT_S:.0f})")
    group.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                       help=f"the same during start-up (model load and proofs on every rank; default "
                            f"{DEFAULT_STARTUP_TIMEOUT_S:.0f})")
    group.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                       help=f"seconds to wait for every rank to join (default {DEFAULT_CONNECT_TIMEOUT_S:.0f})")


def _settings(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def check_startup(world, args, problem: str | None) -> None:
    """Every rank learns of a problem on any rank, and of version or setting mismatches."""
    from lockstep.server.distributed.world import DistributedStartupError, require_same_everywhere, software_identity
    from lockstep.server.distributed.collectives import gather_bytes

    problems = [b.decode() for b in gather_bytes(world.group, (problem or "").encode()[:4000])]
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if found:
        raise DistributedStartupError("; ".join(found))
    require_same_everywhere(world, "software", software_identity(_settings(args)))


def rank_options(options, world, limit: int | None):
    """This rank's runtime options: its shard of the model, proofs made afresh (every rank the
    same passes), no KV pool."""
    from lockstep.server.distributed.sharding import shard_model

    return dataclasses.replace(options, reuse_proofs=False, kv_pool="off",
                               prepare_model=lambda model: shard_model(model, world, limit or 0))


def _agree_on_runtime(world, runtime, kv_tokens: int):
    """Compare what the ranks built; every rank takes rank 0's KV budget, pass costs and
    draft-model decision (all measured, so they may differ per rank, and admission and
    speculation use them)."""
    from lockstep.server.distributed.collectives import broadcast_bytes
    from lockstep.server.distributed.world import require_same_everywhere
    from lockstep.server.fingerprint import weights_digest

    guarantee = runtime.deployment.guarantee
    require_same_everywhere(world, "the built runtime", {
        "weights": weights_digest(str(runtime.loaded.path)), "transform": runtime.transform,
        "strategy": guarantee.strategy, "limit": guarantee.call_rows, "guaranteed": guarantee.guaranteed,
        "shared_passes": guarantee.shared_passes})
    shared = pickle.loads(broadcast_bytes(world.group, pickle.dumps(
        (kv_tokens, runtime.deployment.pass_costs, {name: getattr(runtime.deployment, name) for name in DRAFT_DECISION}))
        if world.is_root else None))
    return shared


# The draft model's measured costs and whether it is drafted from (server/draft_assessment.py assess_draft).
DRAFT_DECISION = ("draft_refusal", "draft_step_cost", "draft_prefill_tokens", "draft_costs")


def _fingerprint(world, runtime, prefill_chunk: int) -> str:
    from lockstep.kernels import cpu_blas
    from lockstep.server.fingerprint import system_fingerprint

    return system_fingerprint(runtime.loaded.path, transform=runtime.transform,
                              strategy=runtime.deployment.guarantee.strategy,
                              limit=runtime.deployment.guarantee.call_rows,
                              blas=cpu_blas.describe(), prefill_chunk=prefill_chunk,
                              topology=f"{world.parallel}/{world.size}/{world.backend}")


def agreed_deployment(world, runtime, kv_tokens: int, prefill_chunk: int):
    """(KV budget, Deployment) every rank runs: rank 0's budget and pass costs, the
    fingerprint naming the topology."""
    kv_tokens, pass_costs, draft = _agree_on_runtime(world, runtime, kv_tokens)
    return kv_tokens, dataclasses.replace(runtime.deployment, pass_costs=pass_costs, **draft,
                                          fingerprint=_fingerprint(world, runtime, prefill_chunk))


def model_extras(world) -> dict:
    """What `/v1/models` adds for a distributed deployment."""
    return {"distributed": {"world_size": world.size, "backend": world.backend, "parallel": world.parallel}}


def gate_on_health(app, watchdog) -> None:
    """Every route (/health included) answers 503 once the deployment has failed."""
    from fastapi.responses import JSONResponse

    from lockstep.server.api.errors import RETRY_AFTER_S

    @app.middleware("http")
    async def deployment_failed(request, call_next):
        if watchdog.failed is not None:  # outside the app's RetryAfter middleware: it says its own
            return JSONResponse(status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}, content={"error": {
                "message": f"the distributed deployment failed: {watchdog.failed}",
                "type": "server_error", "param": None, "code": "deployment_failed"}})
        return await call_next(request)
