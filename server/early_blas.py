"""`serve`'s CPU BLAS, chosen from the raw command line before the CLI's parser is built.

Putting the OpenBLAS shim in place re-executes the process (kernels/cpu_blas.py
`ensure_preloaded`). Building the parser imports mlx-lm, transformers and fastapi (the
commands' defaults live beside what they configure), so a re-exec after it paid those
imports twice. Reading `--cpu-blas` first, with nothing heavy imported, puts the re-exec at
the start. `serve`'s own `apply_cpu_blas` then finds the choice in force and does nothing.
Imports nothing heavy itself.
"""
from __future__ import annotations

import argparse
import sys

# serve's --cpu-blas default (server/options.py DEFAULT_CPU_BLAS; a test keeps them equal).
DEFAULT = "auto"
# The commands whose start is timed to a first answer: the rest re-exec where they always did.
COMMANDS = ("serve",)


def auto_cpu_blas() -> str:
    """`--cpu-blas auto`: OpenBLAS where MLX computes on the CPU of a Linux host.

    There float32 on OpenBLAS prefills and decodes faster than q4 on the reference BLAS
    (README: the CPU default); on a GPU the BLAS is not on the model's path, so the process
    is left as it is.
    """
    if not sys.platform.startswith("linux"):
        return "reference"
    import mlx.core as mx  # cheap (no model code); the shim is preloaded by a fresh process anyway

    return "openblas" if mx.default_device().type == mx.DeviceType.cpu else "reference"


def command_and_rest(argv: list[str]) -> tuple[str | None, list[str]]:
    """The subcommand in `argv` (the CLI's arguments, without the program) and what follows
    it; (None, []) when there is none. The CLI's only option before it is --log-level."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level":
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg, argv[i + 1:]
    return None, []


def requested_cpu_blas(argv: list[str]) -> str | None:
    """The BLAS `serve` will ask for ("openblas" | "reference"), read as its parser reads
    --cpu-blas (abbreviations included); None for another command, for help, or where the
    parser will reject the arguments anyway."""
    command, rest = command_and_rest(argv)
    if command not in COMMANDS or "-h" in rest or "--help" in rest:  # help starts nothing
        return None
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--cpu-blas", default=DEFAULT)
    try:
        known, _ = parser.parse_known_args(rest)
    except (argparse.ArgumentError, SystemExit):
        return None
    choice = known.cpu_blas
    if choice == "auto":
        return auto_cpu_blas()
    return choice if choice in ("openblas", "reference") else None


def apply_early(argv: list[str]) -> None:
    """Re-exec now with the shim preloaded where `serve` will want it (returns when it is
    already in place, or is not wanted)."""
    if requested_cpu_blas(argv) == "openblas":
        from lockstep.kernels.cpu_blas import ensure_preloaded

        ensure_preloaded(choice="openblas")
