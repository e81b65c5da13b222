"""server/cli.py: the `lockstep` entry point's logging before and after its parser."""
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.kernels import cpu_blas
from lockstep.server.cli import requested_log_level

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, level", [
    (["--log-level", "WARNING", "serve"], logging.WARNING),
    (["--log-level=debug", "serve", "--port", "1"], logging.DEBUG),
    (["serve", "--log-level", "ERROR"], logging.INFO),  # serve's own arguments: not the CLI's option
    (["--log-level", "bogus", "serve"], logging.INFO),  # the parser reports it
    ([], logging.INFO),
])
def test_the_log_level_is_read_before_the_parser(argv, level):
    assert requested_log_level(argv) == level


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OpenBLAS re-exec is Linux-only")
def test_the_early_re_exec_logs_at_the_requested_level(tmp_path):
    """With `--log-level WARNING` a start whose OpenBLAS shim is built first (an empty cache
    root) prints no INFO line: the shim's build and the re-exec log before the parser reads
    the level. A busy port ends the start at its bind, after the re-exec."""
    env = cpu_blas.reference_env()  # the shim not yet preloaded: a build and a re-exec
    env["XDG_CACHE_HOME"] = str(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = subprocess.run([sys.executable, "-m", "lockstep.server.cli", "--log-level", "WARNING", "serve",
                               "--cpu-blas", "openblas", "--port", str(busy.getsockname()[1])],
                              capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 1 and "already in use" in proc.stderr
    assert list((tmp_path / "lockstep" / "cpu_blas").glob("*.so"))  # the shim was built in this start
    assert " INFO " not in proc.stderr, proc.stderr
