"""`lockstep serve --parallel tensor|pipeline` under `mlx.launch`: one process per rank.

Start-up, on every rank:
1. join the world (connect timeout), rank 0 binds the HTTP port (a busy port is reported by
   every rank), and the ranks compare lockstep/MLX versions and settings;
2. `build_runtime` with the model sharded for this rank (sharding.py), fresh proofs that
   every rank agrees on (proofs.py); the ranks then compare the outcome (weights, strategy,
   L, guarantee) and take rank 0's KV budget and measured pass costs;
3. the `ReplicatedEngine` runs. Rank 0 serves HTTP (only it binds a port); the others run
   the engine until rank 0 broadcasts stop (exit 0) or the deployment fails (exit 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle

log = logging.getLogger("lockstep.distributed")

DEFAULT_RANK_TIMEOUT_S = 20.0
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_CONNECT_TIMEOUT_S = 120.0
FAILED_GRACE_S = 2.0  # rank 0 answers 503 and ends the streams this long before exiting


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    from lockstep.server.distributed.world import BACKENDS, PARALLEL_MODES

    group = parser.add_argument_group("distributed (run under mlx.launch; docs/DISTRIBUTED.md)")
    group.add_argument("--parallel", choices=PARALLEL_MODES, default=None,
                       help="split the model over the ranks of an mlx.launch: tensor (every layer's "
                            "heads and MLP split, mlx-lm shard()) or pipeline (layers split). Rank 0 "
                            "serves HTTP; answers are reproducible per topology (docs/DETERMINISM.md)")
    group.add_argument("--distributed-backend", choices=("any",) + BACKENDS, default="any",
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


def _check_startup(world, args, problem: str | None) -> None:
    """Every rank learns of a problem on any rank, and of version or setting mismatches."""
    from lockstep.server.distributed.world import DistributedStartupError, require_same_everywhere, software_identity
    from lockstep.server.distributed.collectives import gather_bytes

    problems = [b.decode() for b in gather_bytes(world.group, (problem or "").encode()[:4000])]
    found = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
    if found:
        raise DistributedStartupError("; ".join(found))
    require_same_everywhere(world, "software", software_identity(_settings(args)))


def _agree_on_runtime(world, runtime, kv_tokens: int):
    """Compare what the ranks built; every rank takes rank 0's KV budget and pass costs
    (both measured, so they may differ per rank, and admission and speculation use them)."""
    from lockstep.server.distributed.collectives import broadcast_bytes
    from lockstep.server.distributed.world import require_same_everywhere
    from lockstep.server.fingerprint import weights_digest

    plan = runtime.plan
    require_same_everywhere(world, "the built runtime", {
        "weights": weights_digest(str(runtime.loaded.path)), "transform": runtime.transform,
        "strategy": plan.strategy, "limit": plan.limit, "guaranteed": runtime.deployment.guaranteed,
        "ragged_proven": bool(runtime.deployment.ragged_proof)})
    shared = pickle.loads(broadcast_bytes(world.group, pickle.dumps(
        (kv_tokens, runtime.deployment.pass_costs)) if world.is_root else None))
    return shared


def _fingerprint(world, runtime, args) -> str:
    from lockstep.kernels import cpu_blas
    from lockstep.server.fingerprint import system_fingerprint

    return system_fingerprint(runtime.loaded.path, transform=runtime.transform,
                              strategy=runtime.plan.strategy, limit=runtime.plan.limit,
                              blas=cpu_blas.describe(), prefill_chunk=args.prefill_chunk,
                              topology=f"{world.parallel}/{world.size}/{world.backend}")


def _gate_on_health(app, watchdog) -> None:
    """Every route (/health included) answers 503 once the deployment has failed."""
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def deployment_failed(request, call_next):
        if watchdog.failed is not None:
            return JSONResponse(status_code=503, content={"error": {
                "message": f"the distributed deployment failed: {watchdog.failed}",
                "type": "server_error", "param": None, "code": "deployment_failed"}})
        return await call_next(request)


def run(args: argparse.Namespace) -> int:
    from lockstep.models.errors import ModelError
    from lockstep.server.api import shutdown
    from lockstep.server.commands.runtime_args import apply_cpu_blas, options_from_args
    from lockstep.server.distributed.proofs import agreed_proofs
    from lockstep.server.distributed.replicated_engine import ReplicatedEngine
    from lockstep.server.distributed.sharding import shard_model
    from lockstep.server.distributed.watchdog import Watchdog
    from lockstep.server.distributed.world import DistributedStartupError, join
    from lockstep.server.engine.kv_budget import default_kv_tokens
    from lockstep.server.engine.prefix_cache import PrefixCache
    from lockstep.server.runtime import build_runtime

    apply_cpu_blas(args)  # may re-exec this process (same pid, same launcher variables)
    if min(args.max_active, args.max_batch_rows) < 1 or (args.max_kv_tokens is not None and args.max_kv_tokens < 1):
        log.error("--max-active, --max-batch-rows and --max-kv-tokens must be >= 1")
        return 1
    try:
        world = join(args.parallel, args.distributed_backend, args.connect_timeout)
    except DistributedStartupError as exc:
        log.error("%s", exc)
        return 1
    log.info("rank %d of %d joined: %s", world.rank, world.size, world.describe())
    watchdog = Watchdog(world.rank, args.startup_timeout, grace=FAILED_GRACE_S if world.is_root else 0.0).start()

    sock, problem = None, None
    if world.is_root:
        try:  # a busy port is reported now, by every rank, not after the model load
            sock = shutdown.bind(args.host, args.port)
        except OSError as exc:
            problem = f"{exc.strerror} (is another server running? choose another --port)"
    try:
        _check_startup(world, args, problem)
        options = dataclasses.replace(
            options_from_args(args), reuse_proofs=False, kv_pool="off",
            prepare_model=lambda model: shard_model(model, world, args.batch_invariant_limit or 0))
        with agreed_proofs(world):
            runtime = build_runtime(options)
            kv_tokens, pass_costs = _agree_on_runtime(
                world, runtime, args.max_kv_tokens or default_kv_tokens(runtime.loaded.model))
            deployment = dataclasses.replace(runtime.deployment, pass_costs=pass_costs,
                                             fingerprint=_fingerprint(world, runtime, args))
            engine = ReplicatedEngine(runtime.loaded, world=world, watchdog=watchdog,
                                      max_active=args.max_active, deployment=deployment,
                                      max_batch_rows=args.max_batch_rows, max_kv_tokens=kv_tokens,
                                      prefix_cache=PrefixCache(args.prefix_cache_entries))
    except (DistributedStartupError, ModelError, ValueError, RuntimeError) as exc:
        log.error("rank %d: %s", world.rank, exc)
        shutdown.exit_without_finalizing(1)
    watchdog.on_fail.append(engine.fail_clients)
    watchdog.enter("serving", args.rank_timeout)
    engine.start()
    if not world.is_root:
        engine.join()
        shutdown.exit_without_finalizing(0 if engine.stopped_cleanly and watchdog.failed is None else 1)
    return _serve_http(args, runtime, engine, deployment, sock, watchdog, world)


def _serve_http(args, runtime, engine, deployment, sock, watchdog, world) -> int:
    from lockstep.server.api import access_log, shutdown
    from lockstep.server.api.app import create_app
    from lockstep.server.commands.http_args import http_settings_from_args

    extras = {**runtime.model_info(), "distributed": {
        "world_size": world.size, "backend": world.backend, "parallel": world.parallel}}
    app = create_app(engine, model_extras=extras, fingerprint=deployment.fingerprint,
                     **http_settings_from_args(args))
    _gate_on_health(app, watchdog)
    log.info("serving %s %s on http://%s:%d/v1 (model id %r or \"default\")", engine.loaded.path,
             world.describe(), args.host, args.port, engine.loaded.name)
    try:
        access_log.send_to_stderr()
        shutdown.serve(app, args.host, args.port, drain_timeout=args.drain_timeout, sock=sock,
                       log_level=logging.getLogger().level, access_log=False)
    finally:
        engine.stop()
    shutdown.exit_without_finalizing(0 if engine.stopped_cleanly and watchdog.failed is None else 1)
    return 0
