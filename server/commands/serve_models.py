"""`serve` with several models: each model is the single-model serve assembly's runtime and
engine (serve.py `start_engine`) built with its own options, loaded and unloaded by a
`ModelPool` (server/api/model_pool.py), behind one app."""
from __future__ import annotations

import argparse
import gc
import logging
import sys

import mlx.core as mx

from lockstep.server.api.model_pool import DEFAULT_LOAD_TIMEOUT_S, LoadedService, ModelEntry, ModelPool

log = logging.getLogger("lockstep.serve")

# The weights of every loaded model together, by default: this share of MLX's memory limit (each
# engine's default KV budget then takes its share of what is left when it loads).
DEFAULT_MODELS_MEMORY_FRACTION = 0.5


def weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(value.nbytes for _, value in tree_flatten(model.parameters()))


def load_service(args: argparse.Namespace, entry: ModelEntry, start_engine) -> LoadedService:
    """One model's runtime and started engine, built as a single-model server builds its own
    (`start_engine`: serve.py's)."""
    runtime, engine = start_engine(argparse.Namespace(**{**vars(args), **entry.options}))
    return LoadedService(engine=engine, info=runtime.model_info, nbytes=weights_bytes(runtime.loaded.model))


def stop_service(service: LoadedService) -> None:
    service.engine.stop()


def reclaim_memory() -> None:
    """After an unload dropped its last references: the arrays freed, MLX's buffer cache emptied."""
    gc.collect()
    mx.clear_cache()


def model_pool(args: argparse.Namespace, entries: list[ModelEntry], start_engine) -> ModelPool:
    budget = args.models_memory_bytes
    if budget is None:
        budget = max(1, int(DEFAULT_MODELS_MEMORY_FRACTION * mx.get_memory_limit()))
    return ModelPool(entries, lambda entry: load_service(args, entry, start_engine), stop_service, reclaim_memory,
                     budget_bytes=budget, idle_unload_s=args.idle_unload,
                     load_timeout_s=DEFAULT_LOAD_TIMEOUT_S if args.load_timeout is None else args.load_timeout)


def build_pool_app(args: argparse.Namespace, start_engine):
    """The app over every model `args` name, each built by `start_engine` (serve.py's; ValueError:
    bad flags or config). Returns (app, pool): the pool started (its models preloaded with --preload)."""
    from lockstep.server.api.app import create_app
    from lockstep.server.commands.http_args import http_settings_from_args
    from lockstep.server.commands.models_config import model_entries

    pool = model_pool(args, model_entries(args), start_engine)
    app = create_app(pool=pool, guarantee_timeout=args.guarantee_timeout,
                     deterministic_by_default=args.deterministic_by_default, record_dir=args.record,
                     **http_settings_from_args(args))
    log.info("models: %s (\"default\": %s)", ", ".join(pool.models), pool.default)
    if args.record:
        from lockstep.server.tools.replay_server import record_deployment

        record_deployment(args.record, sys.argv)
    return app, pool.start(preload=args.preload)
