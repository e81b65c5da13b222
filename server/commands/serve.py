"""`lockstep serve`: load a model and serve the OpenAI-compatible API over HTTP.

Three steps, so new options slot in where they act: `add_arguments` (flags), the one serve
assembly (`start_engine` then `build_app`: runtime -> engine -> app) and `run` (uvicorn).
The assembly takes a `world`: `serve --parallel` under mlx.launch (`run_rank`) runs it on
every rank with that rank's world (server/distributed/startup.py: what a world adds);
rank 0 serves HTTP, the others run the replicated engine.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from lockstep.server.commands.models_config import add_models_arguments, several_models, single_model
from lockstep.server.commands.runtime_args import (add_determinism_arguments, add_model_arguments,
                                                   apply_cpu_blas, apply_cuda_graphs, options_from_args)
from lockstep.server.engine.scheduling.admission import MAX_SIZED_ACTIVE, TYPICAL_REQUEST_TOKENS
from lockstep.server.options import (DEFAULT_HOST, DEFAULT_MAX_ACTIVE, DEFAULT_MAX_BATCH_ROWS, DEFAULT_PORT,
                                     DEFAULT_PREFIX_CACHE_ENTRIES, DEFAULT_PROMPT_CACHE_BYTES,
                                     DEFAULT_PROMPT_CACHE_DIR, DEFAULT_PROMPT_CACHE_DISK_BYTES)

log = logging.getLogger("lockstep.serve")
rank_log = logging.getLogger("lockstep.distributed")  # a rank's start-up, as the distributed layer logs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, repeatable=True)
    add_models_arguments(parser)
    add_determinism_arguments(parser)
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--max-active", type=int, default=None,
                        help=f"requests generated concurrently, batched into shared forward passes "
                             f"(default: on a GPU as many as the KV budget holds at {TYPICAL_REQUEST_TOKENS} "
                             f"tokens each, {DEFAULT_MAX_ACTIVE}..{MAX_SIZED_ACTIVE}; {DEFAULT_MAX_ACTIVE} on the CPU; "
                             f"the startup log and /v1/models say the number and why)")
    parser.add_argument("--max-active-per-request", type=int, default=None,
                        help="choices of one request (n) generated at once; its other choices start as "
                             "these finish, and other requests may go first, so one request never takes "
                             "every slot (default: three quarters of --max-active)")
    parser.add_argument("--max-batch-rows", type=int, default=None,
                        help=f"most rows in one decode pass (a pass with a deterministic row holds at most "
                             f"as many as the startup's ragged proof covered, up to this; the proof covers "
                             f"every width up to it) (default: on a GPU the larger of {DEFAULT_MAX_BATCH_ROWS} and "
                             f"--max-active; {DEFAULT_MAX_BATCH_ROWS} on the CPU)")
    parser.add_argument("--async-eval-layers", type=int, default=0, metavar="N",
                        help="decode passes start evaluating every N layers while the host builds the "
                             "rest, so the device need not wait for the whole graph (same ops, same "
                             "bits; 0 = off, the default; not with --parallel)")
    parser.add_argument("--compiled-passes", choices=("on", "off"), default="on",
                        help="plain decode passes over the KV pool's kernel run as one compiled call per "
                             "row count instead of being built op by op (on, the default; off with "
                             "--parallel or --async-eval-layers)")
    parser.add_argument("--decode-ahead", choices=("on", "off"), default="on",
                        help="while the device runs a compiled decode pass, build the next one on its "
                             "tokens still on the device, where every request's next row is known "
                             "there (no drafts, no logits processors): the same passes, the same bits "
                             "(on, the default)")
    parser.add_argument("--max-kv-tokens", type=int, default=None,
                        help="KV cache budget in tokens: requests are admitted while their prompt + "
                             "max_tokens fit, the rest queue (default: half the memory MLX may still "
                             "use after loading the model)")
    parser.add_argument("--memory-limit", type=byte_size, default=None, metavar="BYTES",
                        help="the most device memory this server uses: MLX's memory limit and its buffer "
                             "cache's, so several servers can share one GPU (suffixes K, M, G; default: "
                             "MLX's own, sized from the whole device); the default --max-kv-tokens is half "
                             "of what it leaves after the model")
    parser.add_argument("--prefix-cache-entries", type=int, default=DEFAULT_PREFIX_CACHE_ENTRIES,
                        help="prompt KV snapshots kept in memory for reuse (0 = off)")
    parser.add_argument("--prompt-cache-bytes", type=byte_size, default=DEFAULT_PROMPT_CACHE_BYTES, metavar="BYTES",
                        help="most bytes of prompt KV kept in memory, least recently used dropped first "
                             "(suffixes K, M, G; default 2G)")
    parser.add_argument("--prompt-cache-dir", default=DEFAULT_PROMPT_CACHE_DIR, metavar="off|auto|DIR",
                        help="keep prompt KV on disk too, in blocks a restarted server finds again: auto = "
                             "prompt_kv/ under lockstep's cache dir (default off; not with --parallel)")
    parser.add_argument("--prompt-cache-disk-bytes", type=byte_size, default=DEFAULT_PROMPT_CACHE_DISK_BYTES,
                        metavar="BYTES", help="most bytes of prompt KV on disk, least recently used deleted "
                                              "first (suffixes K, M, G; default 8G)")
    from lockstep.server.engine.structured.grammar_sandbox import DEFAULT_TIMEOUT_S

    parser.add_argument("--grammar-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="longest a request's response_format schema or tools grammar may take to compile "
                             "in the grammar checker process; slower ones are a 400 (default "
                             f"{DEFAULT_TIMEOUT_S:g})")

    from lockstep.server.api.submission import DEFAULT_GUARANTEE_TIMEOUT_S

    parser.add_argument("--guarantee-timeout", type=float, default=DEFAULT_GUARANTEE_TIMEOUT_S, metavar="SECONDS",
                        help="the server answers plain requests while it proves its determinism guarantee; a "
                             "deterministic request waits this long for the proof, then gets a 503 with "
                             f"Retry-After (default {DEFAULT_GUARANTEE_TIMEOUT_S:g})")
    parser.add_argument("--record", default=None, metavar="DIR",
                        help="append each answered request, its answers' token ids and receipts to "
                             "DIR/requests.jsonl (rotated by size), for `lockstep replay`; never headers or keys")
    parser.add_argument("--deterministic-by-default", action="store_true",
                        help="requests that do not send `deterministic` are deterministic (for clients that "
                             "cannot send extra fields; the model name `default:deterministic` also asks for it)")

    # HTTP service hardening: keys, limits, access log, draining.
    from lockstep.server.commands.http_args import add_http_arguments
    add_http_arguments(parser)

    from lockstep.server.distributed.startup import add_distributed_arguments
    add_distributed_arguments(parser)


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_arguments(parser)
    parser.set_defaults(func=run)


def byte_size(text: str) -> int:
    """`4096`, `512M`, `2G` -> bytes (argparse type)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B")
    scale = units.get(text[-1:], 1)
    try:
        value = float(text[:-1] if text[-1:] in units else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}")
    return int(value)


def prompt_cache_from_args(args: argparse.Namespace):
    """The engine's prefix cache: the memory tier, and the disk tier where --prompt-cache-dir
    names one (a directory that cannot be made: one warning, no disk tier)."""
    from lockstep.server.engine.cache.prefix_cache import PrefixCache

    disk = None
    if args.prompt_cache_dir != "off":
        from lockstep.models.cache_dir import reason, user_root
        from lockstep.server.engine.cache.prompt_cache_disk import DiskPromptCache

        root = user_root() / "prompt_kv" if args.prompt_cache_dir == "auto" else args.prompt_cache_dir
        try:
            disk = DiskPromptCache(root, args.prompt_cache_disk_bytes)
            log.info("prompt cache on disk: %s (%d of %d bytes used)", disk.root, disk.bytes, disk.max_bytes)
        except OSError as exc:
            log.warning("prompt cache: %s cannot be used (%s); prompts are cached in memory only", root, reason(exc))
    return PrefixCache(args.prefix_cache_entries, max_bytes=args.prompt_cache_bytes, disk=disk)


def check_engine_arguments(args: argparse.Namespace) -> None:
    """The engine flags' ranges (ValueError), checked before anything is loaded."""
    given = [v for v in (args.max_active, args.max_batch_rows, args.max_kv_tokens) if v is not None]
    if min(given, default=1) < 1:
        raise ValueError("--max-active, --max-batch-rows and --max-kv-tokens must be >= 1")
    if args.memory_limit is not None and args.memory_limit < 1:
        raise ValueError("--memory-limit must be above 0")
    check_per_request(args.max_active_per_request, args.max_active)
    if not args.guarantee_timeout >= 0:
        raise ValueError("--guarantee-timeout must be >= 0")
    if args.async_eval_layers < 0:
        raise ValueError("--async-eval-layers must be >= 0")
    if args.prompt_cache_dir != "off" and args.parallel:
        # every rank must find the same prefixes: one directory's state is not agreed between them
        raise ValueError("--prompt-cache-dir does not work with --parallel")
    if args.async_eval_layers and args.parallel:
        # every rank must meet its collectives in the same order as the others
        raise ValueError("--async-eval-layers does not work with --parallel")


def check_per_request(per_request: int | None, max_active: int | None) -> None:
    """--max-active-per-request against --max-active (None: not known yet, sized at startup)."""
    if per_request is not None and not 1 <= per_request <= (max_active or per_request):
        raise ValueError(f"--max-active-per-request must be in 1..--max-active"
                         f"{'' if max_active is None else f' ({max_active})'}")


def start_engine(args: argparse.Namespace, world=None, watchdog=None):
    """The serve assembly's first half: runtime -> engine, started. Returns (runtime, engine).

    `world` None: one process, an `Engine`. With a world (and its watchdog): this rank's shard
    of the model, proofs every rank agrees on, rank 0's KV budget and pass costs and the
    topology in the fingerprint, a `ReplicatedEngine` whose failure reaches the clients.
    """
    from lockstep.server.engine.scheduling.kv_budget import check_memory_left, default_kv_tokens
    from lockstep.server.runtime import build_runtime

    options = options_from_args(args)
    proofs = contextlib.nullcontext()
    if world is not None:
        from lockstep.server.distributed.proofs import agreed_proofs
        from lockstep.server.distributed.startup import rank_options

        options, proofs = rank_options(options, world, args.batch_invariant_limit), agreed_proofs(world)
    with proofs:  # a world's proofs: around the runtime and the engine's construction
        # One process proves its guarantee after serving starts (the engine thread runs the
        # proofs between plain passes); a world's ranks agree on theirs before.
        runtime = build_runtime(options, defer_guarantee=world is None)  # logs model, load time, audit
        check_memory_left(args.memory_limit)
        kv_tokens = args.max_kv_tokens or default_kv_tokens(runtime.loaded.model)
        admission = serve_admission(args, runtime, kv_tokens, gpu=world is None and on_gpu())
        settings = dict(max_active=admission.max_active, max_batch_rows=admission.max_batch_rows,
                        max_active_per_request=args.max_active_per_request,
                        prefix_cache=prompt_cache_from_args(args))
        if world is None:
            from lockstep.server.engine import Engine

            # its own phase: the KV pool's first kernels are compiled here (a fresh CUDA start)
            with runtime.timings.timed("engine"):
                engine = Engine(runtime.loaded, deployment=runtime.deployment, max_kv_tokens=kv_tokens,
                                guarantee=runtime.guarantee, audited=runtime.audited, **settings)
        else:
            from lockstep.server.distributed.replicated_engine import ReplicatedEngine
            from lockstep.server.distributed.startup import agreed_deployment

            kv_tokens, deployment = agreed_deployment(world, runtime, kv_tokens, runtime.deployment.prefill_chunk)
            engine = ReplicatedEngine(runtime.loaded, world=world, watchdog=watchdog, deployment=deployment,
                                      max_kv_tokens=kv_tokens, **settings)
    if watchdog is not None:
        watchdog.on_fail.append(engine.fail_clients)
        watchdog.enter("serving", args.rank_timeout)
    return runtime, engine.start(runtime.pending)


def apply_memory_limit(args: argparse.Namespace) -> None:
    """`--memory-limit`, before MLX allocates anything (server/engine/scheduling/kv_budget.py)."""
    if args.memory_limit:
        from lockstep.server.engine.scheduling.kv_budget import hold_device_memory

        hold_device_memory(args.memory_limit)
        log.info("device memory held to %.2f GB (--memory-limit)", args.memory_limit / (1 << 30))


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.gpu


def serve_admission(args: argparse.Namespace, runtime, kv_tokens: int | None, gpu: bool):
    """The engine's admission (server/engine/scheduling/admission.py: sized from the KV budget on a GPU,
    explicit flags win), given to the runtime (its pending ragged proof covers the pass width;
    /v1/models says it) and logged. A world keeps the fixed defaults: its ranks must agree,
    and its proofs ran before the KV budget was known."""
    from lockstep.server.engine.scheduling.admission import admission_limits
    from lockstep.server.engine.scheduling.kv_budget import device_memory

    admission = admission_limits(kv_tokens, gpu=gpu, max_active=args.max_active, max_batch_rows=args.max_batch_rows)
    check_per_request(args.max_active_per_request, admission.max_active)
    runtime.set_admission(admission)
    log.info("admission: %d requests at once, passes of up to %d rows (%s)",
             admission.max_active, admission.max_batch_rows, admission.reason)
    memory = device_memory()
    if memory is not None:
        log.info("device memory after the load: %s", memory)
    return admission


def build_app(args: argparse.Namespace, runtime, engine, world=None, watchdog=None):
    """The serve assembly's second half: the HTTP app over a started engine (rank 0's only,
    with a world: /v1/models names the topology and every route answers 503 once the
    deployment failed)."""
    from lockstep.server.api.app import create_app
    from lockstep.server.commands.http_args import http_settings_from_args

    extras = runtime.model_info  # read at every request: the guarantee's state changes
    if world is not None:
        from lockstep.server.distributed.startup import model_extras

        extras = {**runtime.model_info(), **model_extras(world)}
    app = create_app(engine, model_extras=extras, guarantee_timeout=args.guarantee_timeout,
                     deterministic_by_default=args.deterministic_by_default, record_dir=args.record,
                     **http_settings_from_args(args))
    if args.record:
        from lockstep.server.tools.replay_server import record_deployment

        record_deployment(args.record, sys.argv)
    if watchdog is not None:
        from lockstep.server.distributed.startup import gate_on_health

        gate_on_health(app, watchdog)
    return app


def build_app_from_args(args: argparse.Namespace):
    """One process: load the model, start the engine and build the app. Returns (app, engine);
    with several models (server/commands/models_config.py) the engine is their `ModelPool`."""
    check_engine_arguments(args)
    if several_models(args):
        from lockstep.server.commands.serve_models import build_pool_app

        return build_pool_app(args, start_engine)
    single_model(args)
    runtime, engine = start_engine(args)
    return build_app(args, runtime, engine), engine


def run(args: argparse.Namespace) -> int:
    from lockstep.server.api import shutdown
    from lockstep.server.engine.structured import grammar_sandbox

    try:
        grammar_sandbox.configure(timeout_s=args.grammar_timeout)
    except ValueError as exc:
        log.error("%s", exc)
        return 1
    if args.parallel:  # one rank of an mlx.launch deployment
        if several_models(args):
            log.error("--parallel serves one model: give one --model and no --models-config")
            return 1
        single_model(args)
        return run_rank(args)
    shutdown.stop_during_startup()  # a stop before serving exits 0 too, not by the signal
    socks: list = []
    try:
        return _run_one_process(args, socks)
    except shutdown.StopRequested as stop:
        log.info("%s during start-up: stopped before serving", stop)
        for sock in socks:
            sock.close()
        shutdown.exit_without_finalizing(0)
    return 0


def _run_one_process(args: argparse.Namespace, socks: list) -> int:
    """`run` for one process, under `stop_during_startup`'s handlers (`socks` gets the bound
    socket, for `run` to close on a stop)."""
    from lockstep.models.errors import ModelError
    from lockstep.server.api import shutdown

    apply_cuda_graphs(args)
    apply_cpu_blas(args)
    apply_memory_limit(args)
    try:  # a busy port is reported now, not after the model load
        sock = shutdown.bind(args.host, args.port)
    except OSError as exc:
        log.error("%s (is another server running? choose another --port)", exc.strerror)
        return 1
    socks.append(sock)
    try:
        connections = connection_limits(args)
        log.info("loading the model")
        app, engine = build_app_from_args(args)
    except (ModelError, ValueError) as exc:
        log.error("%s", exc)
        sock.close()
        return 1
    if getattr(engine, "loaded", None) is not None:
        log.info("serving %s on http://%s:%d/v1 (model id %r or \"default\")",
                 engine.loaded.path, args.host, args.port, engine.loaded.name)
    else:  # a ModelPool
        log.info("serving models %s on http://%s:%d/v1 (\"default\": %r)", ", ".join(engine.models),
                 args.host, args.port, engine.default)
    served = _serve_http(args, app, engine, sock, connections)
    # 1: the port was taken, or the engine (a pool's: one of them) stopped after an error
    shutdown.exit_without_finalizing(0 if served and engine.failure is None else 1)  # MLX teardown after worker-thread use can abort
    return 0


def connection_limits(args: argparse.Namespace):
    """The HTTP connections' cap and deadlines (ValueError when the open-file limit has no room
    for the cap), after raising the soft file limit as far as the hard one allows."""
    import mlx_lm.utils  # noqa: F401  (it sets the file limit when imported: raise it after that)

    from lockstep.server.api import file_limit
    from lockstep.server.commands.http_args import connection_limits_from_args

    return connection_limits_from_args(args, file_limit.raise_soft_limit())


def run_rank(args: argparse.Namespace) -> int:
    """`serve --parallel`: this process is one rank (server/distributed/startup.py has the steps)."""
    from lockstep.models.errors import ModelError
    from lockstep.server.api import shutdown
    from lockstep.server.distributed.startup import FAILED_GRACE_S, check_startup
    from lockstep.server.distributed.watchdog import Watchdog
    from lockstep.server.distributed.world import DistributedStartupError, join

    apply_cuda_graphs(args)
    apply_cpu_blas(args)  # may re-exec this process (same pid, same launcher variables)
    apply_memory_limit(args)
    try:
        check_engine_arguments(args)
        connections = connection_limits(args)
    except ValueError as exc:
        rank_log.error("%s", exc)
        return 1
    try:
        world = join(args.parallel, args.distributed_backend, args.connect_timeout)
    except DistributedStartupError as exc:
        rank_log.error("%s", exc)
        return 1
    rank_log.info("rank %d of %d joined: %s", world.rank, world.size, world.describe())
    watchdog = Watchdog(world.rank, args.startup_timeout, grace=FAILED_GRACE_S if world.is_root else 0.0).start()

    sock, problem = None, None
    if world.is_root:
        try:  # a busy port is reported now, by every rank, not after the model load
            sock = shutdown.bind(args.host, args.port)
        except OSError as exc:
            problem = f"{exc.strerror} (is another server running? choose another --port)"
    try:
        check_startup(world, args, problem)
        runtime, engine = start_engine(args, world, watchdog)
    except (DistributedStartupError, ModelError, ValueError, RuntimeError) as exc:
        rank_log.error("rank %d: %s", world.rank, exc)
        shutdown.exit_without_finalizing(1)
    exit_code = lambda: 0 if engine.stopped_cleanly and watchdog.failed is None and engine.failure is None else 1  # noqa: E731
    if not world.is_root:
        engine.join()
        shutdown.exit_without_finalizing(exit_code())
    app = build_app(args, runtime, engine, world, watchdog)
    rank_log.info("serving %s %s on http://%s:%d/v1 (model id %r or \"default\")", engine.loaded.path,
                  world.describe(), args.host, args.port, engine.loaded.name)
    served = _serve_http(args, app, engine, sock, connections)
    shutdown.exit_without_finalizing(exit_code() if served else 1)
    return 0


def _serve_http(args: argparse.Namespace, app, engine, sock, connections=None) -> bool:
    """uvicorn on the socket bound at start, until SIGTERM/SIGINT/SIGHUP (or the engine's failure)
    and the drain; then the engine stops. False: the port was taken while the model loaded (another server bound it too and
    listened first), said in one line."""
    import errno

    from lockstep.server.api import access_log, shutdown
    from lockstep.server.api.connections import ConnectionLimits

    try:
        if sock is not None:
            try:  # listen here, before uvicorn starts, so a port taken meanwhile is one line
                sock.listen(shutdown.BACKLOG)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                log.error("cannot listen on %s:%d: %s (another server took the port while this one "
                          "loaded; choose another --port)", args.host, args.port, exc.strerror)
                return False
        access_log.send_to_stderr()  # bare JSON lines replace uvicorn's access log
        shutdown.serve(app, args.host, args.port, drain_timeout=args.drain_timeout, sock=sock,
                       connections=connections or ConnectionLimits(), failure=lambda: engine.failure,
                       log_level=logging.getLogger().level, access_log=False)
    finally:
        engine.stop()
    return True
