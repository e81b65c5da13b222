"""The client conformance suite: the libraries people point at an OpenAI-compatible server,
each against one `lockstep serve` on the embedded model, shared by the whole suite, offline.

The server is the real command, as a new user starts it (`auto` weights: float32 on OpenBLAS
here), not the in-process test server: its prompt prefill is far faster than the reference
BLAS the in-process model runs on, and tool prompts are long.

Every client gets the loopback base URL and a dummy key, and no retries (a 5xx fails the test
instead of being retried away). Nothing may leave the machine: a connection to anything but
a loopback address fails the test, so a library that phones home (a price list, a tokenizer
download, telemetry) is caught here rather than hanging in CI. The model is a 135M one: tests
assert what the server guarantees (shapes, fields, round trips, no 5xx), not answer quality.
"""
import ipaddress
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.http_server import free_port, wait_for_health

ROOT = Path(__file__).resolve().parents[2]

# litellm fetches its model price list from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")
for _tracing in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING"):
    os.environ.pop(_tracing, None)

API_KEY = "sk-lockstep-test"  # any key: the live server runs without auth


def _loopback(address) -> bool:
    if not isinstance(address, tuple):  # a Unix socket path
        return True
    try:
        return ipaddress.ip_address(address[0]).is_loopback
    except ValueError:  # a host name: resolving it would already have needed the network
        return address[0] == "localhost"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Connections go to loopback addresses only (the live server)."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect(self, address):
        if not _loopback(address):
            raise AssertionError(f"a client tried to reach {address!r}: the suite runs offline")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not _loopback(address):
            raise AssertionError(f"a client tried to reach {address!r}: the suite runs offline")
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


@pytest.fixture(scope="session")
def api_key():
    return API_KEY


@pytest.fixture(scope="session")
def base_url(tmp_path_factory):
    """`lockstep serve` on a free loopback port for the suite; its OpenAI base URL
    ("http://127.0.0.1:PORT/v1"). A 5xx it answered fails the suite at the end (its access log)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("clients") / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.server.cli", "--log-level", "WARNING", "serve",
                                 "--host", "127.0.0.1", "--port", str(port), "--max-active", "2"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base, log_path, timeout=300)
        yield f"{base}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    server_errors = [line for line in log_path.read_text().splitlines() if '"status": 5' in line]
    assert not server_errors, server_errors
