"""Which models `serve` serves: `--model` given more than once (`NAME=SPEC` names one) and/or
`--models-config FILE`, a JSON or TOML file of models and the options where they differ from the
command line's:

    {"models": [{"name": "smol", "model": "default"},
                {"name": "smol-q4", "model": "default", "quantize": "affine", "q_bits": 4}]}

    [[models]]
    name = "smol"
    model = "default"

A single `--model SPEC` (the default) without the pool's flags is the single-model server, unchanged.
"""
from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

from lockstep.server.api.model_pool import ModelEntry
from lockstep.server.options import DEFAULT_MODEL

# The options a model may set for itself; every other one is the command line's, for all.
PER_MODEL_OPTIONS = ("model", "weights", "quantize", "q_bits", "q_group_size", "draft_model")
ENTRY_KEYS = ("name",) + PER_MODEL_OPTIONS


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-config", default=None, metavar="FILE",
                        help="serve the models a JSON or TOML file lists ({\"models\": [{\"name\", \"model\", "
                             "and optionally weights, quantize, q_bits, q_group_size, draft_model}]}), after "
                             "any --model; several models load on demand (docs/SERVICE.md)")
    parser.add_argument("--preload", action="store_true",
                        help="with several models: load every one at start, not on its first request")
    parser.add_argument("--idle-unload", type=float, default=None, metavar="SECONDS",
                        help="with several models: unload a model after SECONDS without requests "
                             "(default: never)")
    parser.add_argument("--models-memory-bytes", type=int, default=None, metavar="BYTES",
                        help="with several models: the weights loaded at once stay under BYTES; loading "
                             "one more unloads the least recently used idle model first (default: half "
                             "of MLX's memory limit)")
    parser.add_argument("--load-timeout", type=float, default=None, metavar="SECONDS",
                        help="with several models: a request for a model still loading waits this long, "
                             "then gets a 503 with Retry-After (default 120)")


def several_models(args: argparse.Namespace) -> bool:
    """Whether `args` ask for the model pool rather than the single-model server: more than one
    model, a named one, a config file, or a flag only the pool has."""
    models = given_models(args)
    pool_flags = (args.preload, args.idle_unload, args.models_memory_bytes, args.load_timeout)
    return bool(len(models) > 1 or args.models_config or any(_split(m)[0] for m in models)
                or any(flag not in (None, False) for flag in pool_flags))


def given_models(args: argparse.Namespace) -> list[str]:
    """The --model values given (the default one where neither --model nor a config file was)."""
    if getattr(args, "_models_given", None):
        return list(args._models_given)
    if isinstance(args.model, list):
        return list(args.model)
    return [] if args.models_config else [args.model or DEFAULT_MODEL]


def single_model(args: argparse.Namespace) -> None:
    """The single-model server's `args.model`: the one spec (the default where none was given)."""
    if isinstance(args.model, list) or args.model is None:
        args.model = (args.model or [DEFAULT_MODEL])[0]


def model_entries(args: argparse.Namespace) -> list[ModelEntry]:
    """Every model `args` name, `--model`s first, each with its options (ValueError: a bad
    config file, an unknown option, or two models under one name)."""
    base = {key: getattr(args, key, None) for key in PER_MODEL_OPTIONS}
    entries = []
    for value in given_models(args):
        name, spec = _split(value)
        entries.append(_entry({"name": name, "model": spec} if name else {"model": spec}, base, "--model"))
    if args.models_config:
        for raw in read_config(args.models_config):
            entries.append(_entry(raw, base, args.models_config))
    if not entries:
        entries.append(_entry({"model": DEFAULT_MODEL}, base, "--model"))
    names = [e.name for e in entries]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two models are served as {name!r}: name them (--model NAME=SPEC, or "
                             f"\"name\" in --models-config)")
    return entries


def read_config(path: str) -> list[dict]:
    """The models a --models-config file lists (ValueError naming the file otherwise)."""
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as exc:
        raise ValueError(f"--models-config {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text) if file.suffix == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--models-config {path}: not valid {'TOML' if file.suffix == '.toml' else 'JSON'}: "
                         f"{exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise ValueError(f"--models-config {path}: needs \"models\", a list of tables with at least \"model\"")
    return models


def _split(value: str) -> tuple[str, str]:
    """`NAME=SPEC` -> (NAME, SPEC); a plain spec (a path may hold "=" after a "/") -> ("", spec)."""
    name, sep, spec = value.partition("=")
    if sep and name and spec and "/" not in name and not Path(value).expanduser().exists():
        return name, spec
    return "", value


def _entry(raw: dict, base: dict, where: str) -> ModelEntry:
    unknown = sorted(set(raw) - set(ENTRY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown model option {', '.join(map(repr, unknown))} (a model may set "
                         f"{', '.join(ENTRY_KEYS)})")
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise ValueError(f"{where}: every model needs \"model\" (a spec: \"default\", an mlx-lm dir or a .gguf)")
    for key, value in raw.items():
        kind = int if key in ("q_bits", "q_group_size") else str
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{where}: {key!r} must be {'an integer' if kind is int else 'a string'}")
    from lockstep.models.load import served_name

    options = {**base, **{k: v for k, v in raw.items() if k != "name"}}
    return ModelEntry(name=raw.get("name") or served_name(options["model"]), options=options)
