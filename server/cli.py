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


def requested_log_level(argv: list[str]) -> int:
    """The level --log-level asks for, read from the raw arguments before the parser exists
    (the early re-exec logs before it), INFO where it is absent or not a level; the parser
    reads it again."""
    early = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    early.add_argument("--log-level", default="INFO")
    try:
        known, _ = early.parse_known_args(argv[:_command_index(argv)])
    except (argparse.ArgumentError, SystemExit):
        return logging.INFO
    level = logging.getLevelName(str(known.log_level).upper())
    return level if isinstance(level, int) else logging.INFO


def _command_index(argv: list[str]) -> int:
    """Where the subcommand starts: --log-level is the CLI's only option before it."""
    from lockstep.server.early_blas import command_and_rest

    command, rest = command_and_rest(argv)
    return len(argv) - len(rest) - 1 if command is not None else len(argv)


def main(argv: list[str] | None = None) -> int:
    from lockstep.server.torchless import keep_torch_out

    # one log format from the first line on (the early re-exec below may already warn); a
    # process whose logging is set up already (a host program, a test) keeps its own
    ours = not logging.getLogger().handlers
    raw = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=requested_log_level(raw), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
