"""`lockstep` command line: one subcommand per module in server/commands/.

Each command module exposes `register(subparsers)` which adds its parser and sets
`func` (called with the parsed args, returns an exit code). Modules are imported only
when the CLI starts, so `kernels/` and `models/` stay free of server dependencies.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = (
    "lockstep.server.commands.serve",
    "lockstep.server.commands.convert",
    "lockstep.server.commands.audit",
    "lockstep.server.commands.service",
    "lockstep.server.commands.verify",
    "lockstep.server.commands.bench",
    "lockstep.server.commands.replay",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from lockstep.server.torchless import keep_torch_out

    # one log format from the first line on (the early re-exec below may already warn); a
    # process whose logging is set up already (a host program, a test) keeps its own
    ours = not logging.getLogger().handlers
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv is None:  # from the command line: a re-exec re-runs it (sys.orig_argv)
        from lockstep.server.early_blas import apply_early

        apply_early(sys.argv[1:])  # before the parser's imports, which a re-exec would repeat
    keep_torch_out()  # before anything imports transformers
    args = build_parser().parse_args(argv)
    if ours:
        logging.getLogger().setLevel(args.log_level.upper())
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
