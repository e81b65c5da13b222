"""`lockstep serve`: load a model and serve the OpenAI-compatible API over HTTP.

Three steps, so new options slot in where they act: `add_arguments` (flags),
`build_app_from_args` (model -> engine -> app) and `run` (uvicorn).
"""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("lockstep.serve")

from lockstep.server.commands.runtime_args import (add_determinism_arguments, add_model_arguments,
                                          apply_cpu_blas, options_from_args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_determinism_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    from lockstep.server.engine.passes import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS

    parser.add_argument("--max-active", type=int, default=DEFAULT_MAX_ACTIVE,
                        help=f"requests generated concurrently, batched into shared forward passes "
                             f"(default {DEFAULT_MAX_ACTIVE})")
    parser.add_argument("--max-batch-rows", type=int, default=DEFAULT_MAX_BATCH_ROWS,
                        help=f"most rows in one decode pass of non-deterministic requests (passes with a "
                             f"deterministic row hold at most L) (default {DEFAULT_MAX_BATCH_ROWS})")
    parser.add_argument("--max-kv-tokens", type=int, default=None,
                        help="KV cache budget in tokens: requests are admitted while their prompt + "
                             "max_tokens fit, the rest queue (default: half the memory MLX may still "
                             "use after loading the model)")
    parser.add_argument("--prefix-cache-entries", type=int, default=4,
                        help="prompt KV snapshots kept for reuse (0 = off)")

    # HTTP service hardening: keys, limits, access log, draining.
    from lockstep.server.commands.http_args import add_http_arguments
    add_http_arguments(parser)

    from lockstep.server.distributed.serve import add_distributed_arguments
    add_distributed_arguments(parser)


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_arguments(parser)
    parser.set_defaults(func=run)


def build_app_from_args(args: argparse.Namespace):
    """Load the model, start the engine and build the app. Returns (app, engine)."""
    from lockstep.server.api.app import create_app
    from lockstep.server.commands.http_args import http_settings_from_args
    from lockstep.server.engine import Engine
    from lockstep.server.engine.kv_budget import default_kv_tokens
    from lockstep.server.engine.prefix_cache import PrefixCache
    from lockstep.server.runtime import build_runtime

    if min(args.max_active, args.max_batch_rows) < 1 or (args.max_kv_tokens is not None and args.max_kv_tokens < 1):
        raise ValueError("--max-active, --max-batch-rows and --max-kv-tokens must be >= 1")
    runtime = build_runtime(options_from_args(args))  # logs model, load time, audit, invariance
    kv_tokens = args.max_kv_tokens or default_kv_tokens(runtime.loaded.model)
    engine = Engine(runtime.loaded, max_active=args.max_active, deployment=runtime.deployment,
                    max_batch_rows=args.max_batch_rows, max_kv_tokens=kv_tokens,
                    prefix_cache=PrefixCache(args.prefix_cache_entries)).start()
    app = create_app(engine, model_extras=runtime.model_info(),
                     fingerprint=runtime.deployment.fingerprint, **http_settings_from_args(args))
    return app, engine


def run(args: argparse.Namespace) -> int:
    from lockstep.models.errors import ModelError
    from lockstep.server.api import access_log, shutdown

    if args.parallel:  # one rank of an mlx.launch deployment (server/distributed/serve.py)
        from lockstep.server.distributed.serve import run as run_distributed

        return run_distributed(args)
    apply_cpu_blas(args)
    try:  # a busy port is reported now, not after the model load
        sock = shutdown.bind(args.host, args.port)
    except OSError as exc:
        log.error("%s (is another server running? choose another --port)", exc.strerror)
        return 1
    try:
        app, engine = build_app_from_args(args)
    except (ModelError, ValueError) as exc:
        log.error("%s", exc)
        sock.close()
        return 1
    log.info("serving %s on http://%s:%d/v1 (model id %r or \"default\")",
             engine.loaded.path, args.host, args.port, engine.loaded.name)
    try:
        access_log.send_to_stderr()  # bare JSON lines replace uvicorn's access log
        shutdown.serve(app, args.host, args.port, drain_timeout=args.drain_timeout, sock=sock,
                       log_level=logging.getLogger().level, access_log=False)
    finally:
        engine.stop()
    shutdown.exit_without_finalizing(0)  # MLX teardown after worker-thread use can abort
    return 0
