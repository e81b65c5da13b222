"""The deployment a recording came from, started again for `lockstep replay` without `--url`.

`serve --record DIR` writes `DIR/deployment.json` beside the requests: the serve arguments that
make the deployment (model, L, kernels, speculation...), without what only says where it listens
or who may call it (host, port, keys, the recording itself). `replay` then starts
`lockstep serve` with those arguments on a free loopback port, waits until its guarantee is in
force, replays, and stops it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from . import launchd_job

log = logging.getLogger("lockstep.record")

FILE_NAME = "deployment.json"
# Flags that say where the server listens, who may call it or where it records: not the
# deployment, and never written (keys are secrets). Each takes a value.
_NOT_DEPLOYMENT = ("--host", "--port", "--record", "--api-key")


class ReplayServerError(RuntimeError):
    """The recorded deployment could not be started again (the message says why)."""


def deployment_args(argv: list[str]) -> list[str]:
    """The serve arguments of `argv` (what follows `serve`) that make the deployment."""
    args = list(argv[argv.index("serve") + 1:]) if "serve" in argv else list(argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _NOT_DEPLOYMENT:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def write_deployment(directory: str | Path, argv: list[str]) -> Path | None:
    """Write DIR/deployment.json for this serve process (atomically); None when it cannot be
    written (recording goes on: the requests are still replayable with `--url`)."""
    path = Path(directory) / FILE_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"serve_args": deployment_args(argv)}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def record_deployment(directory: str | Path, argv: list[str]) -> None:
    """`serve --record DIR`: write DIR/deployment.json, or warn that the recording needs --url."""
    if write_deployment(directory, argv) is None:
        log.warning("cannot write %s/%s: replay this recording with --url", directory, FILE_NAME)


def recorded_args(recording: str | Path) -> list[str]:
    """The serve arguments recorded beside a requests file (or in a recording directory)."""
    where = Path(recording)
    path = (where if where.is_dir() else where.parent) / FILE_NAME
    try:
        value = json.loads(path.read_text())
        args = value["serve_args"]
    except FileNotFoundError:
        raise ReplayServerError(f"{path} not found: the recording predates it, or was not written by "
                                "`serve --record`; pass --url to replay against a running server") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReplayServerError(f"cannot read {path}: {exc}") from None
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ReplayServerError(f"{path}: serve_args is not a list of strings")
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def started(args: list[str], *, timeout: float = 900.0, log=None) -> Iterator[str]:
    """`lockstep serve ARGS` on a free loopback port until the block ends; yields its URL once
    its guarantee is in force (or off). ReplayServerError when it exits, refuses its guarantee or
    does not get there within `timeout` seconds (the end of its log in the message)."""
    port = free_port()
    command = [sys.executable, "-m", "lockstep.server.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(port)]
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_for_guarantee(process, url, timeout, output, log)
            yield url
        finally:
            _stop(process)


def _tail(output, lines: int = 20) -> str:
    output.flush()
    output.seek(0)
    return "".join(output.readlines()[-lines:])


def _wait_for_guarantee(process, url: str, timeout: float, output, log) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ReplayServerError(f"the recorded deployment exited ({process.returncode}) before it served:\n"
                                    + _tail(output))
        healthy, _, body = launchd_job.check_health(url + "/health")
        state = launchd_job.reached("guarantee", healthy, body)
        if state:
            if log:
                log(f"the recorded deployment serves at {url} (guarantee {body.get('guarantee', 'in_force')})")
            return
        if state is None:
            raise ReplayServerError("the recorded deployment refused its guarantee on this machine:\n"
                                    + _tail(output))
        if time.monotonic() >= deadline:
            raise ReplayServerError(f"the recorded deployment was not serving with its guarantee after "
                                    f"{timeout:g} s:\n" + _tail(output))
        time.sleep(0.5)


def _stop(process) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
