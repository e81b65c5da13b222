"""`lockstep serve`: load a model and serve the OpenAI-compatible API over HTTP.

Three steps, so new options slot in where they act: `add_arguments` (flags),
`build_app_from_args` (model -> engine -> app) and `run` (uvicorn).
"""
from __future__ import annotations

import argparse
import logging

log = logging.getLogger("lockstep.serve")

WEIGHT_CHOICES = ("auto", "q4", "float32", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help='"default" (the embedded SmolLM2-135M-Instruct), an mlx-lm dir or a .gguf')
    parser.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                        help="weight format (default auto: as stored)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--max-active", type=int, default=4,
                        help="requests generated concurrently, token by token (default 4)")


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_arguments(parser)
    parser.set_defaults(func=run)


def build_app_from_args(args: argparse.Namespace):
    """Load the model, start the engine and build the app. Returns (app, engine)."""
    from models.load import load_model
    from server.app import create_app
    from server.engine import Engine

    loaded = load_model(spec=args.model, weights=args.weights)  # logs name, path, load time
    engine = Engine(loaded, max_active=args.max_active).start()
    return create_app(engine), engine


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from models.errors import ModelError

    try:
        app, engine = build_app_from_args(args)
    except ModelError as exc:
        log.error("%s", exc)
        return 1
    log.info("serving %s on http://%s:%d/v1 (model id %r or \"default\")",
             engine.loaded.path, args.host, args.port, engine.loaded.name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=logging.getLogger().level, access_log=True)
    finally:
        engine.stop()
    return 0
