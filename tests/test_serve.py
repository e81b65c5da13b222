"""`lockstep serve` as a real process, where sockets and signals need one:

- at a low open-file limit, more idle and slow (slowloris) connections than the limit: a
  4-token request from the official client still answers within 2 s of its normal time, and the
  log stays a line or two (it used to stall every client and log accept tracebacks thousands
  of times a second);
- SIGHUP drains like SIGTERM: the stream in flight finishes whole, the process exits 0;
- SIGTERM during start-up (the model loading) exits 0, not by the signal (launchd restarts that).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from openai import OpenAI

from tests.http_server import free_port, wait_for_health, wait_until

ROOT = Path(__file__).resolve().parents[1]
FILE_LIMIT = 256  # the server's cap is then the limit less server/api/file_limit.py's reserve
IDLE, SLOW_HEADERS, SLOW_BODIES = 2 * FILE_LIMIT, 16, 16
# mlx-lm sets the file limit to (2048, 4096) when imported and fails under a lower hard limit,
# so the child lowers it right after that import, as a host with few descriptors would have it.
LOW_LIMIT_LAUNCH = ("import resource, sys, mlx_lm.utils; "
                    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({FILE_LIMIT}, {FILE_LIMIT})); "
                    "from lockstep.server.cli import main; sys.exit(main(sys.argv[1:]))")
ENV = {**os.environ, "LOCKSTEP_API_KEYS": ""}


def log_lines(path) -> list[str]:
    return Path(path).read_text().splitlines()


@pytest.fixture(scope="module")
def low_limit_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    port = free_port()
    with open(log_path, "w") as log:  # header deadline far off: the cap alone must keep clients served
        proc = subprocess.Popen([sys.executable, "-c", LOW_LIMIT_LAUNCH, "serve", "--port", str(port),
                                 "--header-timeout", "300", "--drain-timeout", "120"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base, log_path)
        yield proc, base, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def four_tokens(client) -> float:
    """Seconds a plain 4-token completion takes."""
    start = time.monotonic()
    answer = client.completions.create(model="default", prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    return time.monotonic() - start


def test_idle_and_slow_connections_past_the_file_limit_do_not_stall_clients(low_limit_server):
    proc, base, log_path = low_limit_server
    host, port = "127.0.0.1", int(base.rsplit(":", 1)[1])
    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    four_tokens(client)  # warm
    normal = max(four_tokens(client), four_tokens(client))  # on a shared machine: its slower run
    before = len(log_lines(log_path))
    attack = []
    try:
        for i in range(IDLE + SLOW_HEADERS + SLOW_BODIES):
            sock = socket.create_connection((host, port), timeout=30)
            attack.append(sock)
            if i >= IDLE + SLOW_BODIES:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            elif i >= IDLE:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999\r\n\r\n{\"mo")
        during = four_tokens(OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=normal + 30))
        assert during <= normal + 2.0, (normal, during)
        assert httpx.get(base + "/health", timeout=30).status_code == 200
    finally:
        for sock in attack:
            sock.close()
    assert proc.poll() is None
    new = [line for line in log_lines(log_path)[before:] if not line.startswith("{")]  # not access-log JSON
    assert 1 <= len(new) <= 3, new
    assert "closed at the cap" in new[0] and not any("Traceback" in line or "accept" in line for line in new)


def test_sighup_drains_like_sigterm(low_limit_server):
    """Runs after the test above: it ends the module's server."""
    proc, base, log_path = low_limit_server
    body = {"model": "default", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base, timeout=300) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: httpx.get(base + "/health").status_code == 503, what="draining")
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 16
    assert proc.wait(timeout=120) == 0


def test_sigterm_during_startup_exits_0(tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.server.cli", "serve", "--port", str(free_port())],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_until(lambda: proc.poll() is not None or "loading the model" in log_path.read_text(),
                   timeout=300, what="the model load to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "SIGTERM during start-up: stopped before serving" in text
    assert "/v1 (model id" not in text  # the "serving ... on http://..." line: it never served
