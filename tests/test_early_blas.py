"""`serve`'s CPU BLAS read from the raw command line (server/early_blas.py), so the
OpenBLAS re-exec happens before the CLI's parser imports mlx-lm, transformers and fastapi.

The early reading must be the parser's own: where they disagreed, the process would be
re-executed into a BLAS `serve` did not ask for (or `serve` would re-exec after all).
"""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.kernels import cpu_blas
from lockstep.server.cli import build_parser
from lockstep.server import early_blas
from lockstep.server.early_blas import command_and_rest, requested_cpu_blas
from lockstep.server.commands.runtime_args import auto_cpu_blas
from lockstep.server.options import DEFAULT_CPU_BLAS

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")


@pytest.mark.parametrize("argv", [
    ["serve"],
    ["serve", "--cpu-blas", "reference"],
    ["serve", "--cpu-blas=reference"],
    ["serve", "--cpu-blas", "openblas", "--port", "9"],
    ["serve", "--cpu-b", "reference"],  # argparse takes unambiguous abbreviations
    ["--log-level", "DEBUG", "serve", "--cpu-blas", "reference"],
    ["--log-level=DEBUG", "serve", "--port", "8001", "--cpu-blas", "auto"],
    ["serve", "--model", "default", "--batch-invariant-limit", "8"],
])
def test_the_early_reading_is_the_parsers(argv):
    args = build_parser().parse_args(argv)
    parsed = auto_cpu_blas() if args.cpu_blas == "auto" else args.cpu_blas
    assert requested_cpu_blas(argv) == parsed


@pytest.mark.parametrize("argv", [[], ["--log-level", "DEBUG"], ["verify"], ["bench", "--cpu-blas", "openblas"],
                                  ["serve", "--cpu-blas"], ["serve", "--cpu-blas", "bogus"], ["serve", "--help"]])
def test_nothing_is_applied_early_for_other_commands_help_or_arguments_the_parser_rejects(argv):
    assert requested_cpu_blas(argv) is None


def test_the_early_default_is_serves():
    assert early_blas.DEFAULT == DEFAULT_CPU_BLAS == build_parser().parse_args(["serve"]).cpu_blas


def test_the_command_is_found_past_the_global_option():
    assert command_and_rest(["--log-level", "serve", "serve", "--port", "1"]) == ("serve", ["--port", "1"])


@pytest.mark.skipif(not LINUX, reason="the OpenBLAS re-exec is Linux-only")
def test_serve_re_executes_before_importing_transformers():
    """A real `serve` start up to its bind (a busy port ends it there, after the BLAS is in
    place): the interpreter starts twice (the re-exec), transformers is imported once."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lockstep.server.cli", "serve",
                               "--cpu-blas", "openblas", "--port", str(busy.getsockname()[1])],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=cpu_blas.reference_env())  # the shim not yet preloaded: a re-exec
    assert proc.returncode == 1 and "already in use" in proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert imported.count("encodings") == 2  # two interpreter starts
    assert imported.count("transformers") == 1
