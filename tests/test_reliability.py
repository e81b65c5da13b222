"""Under load and at shutdown: answers stay whole and belong to their request.

- 16 concurrent streaming clients on the shared live server (4 slots), a quarter of them hanging up
  after their first chunk: every finished stream equals the same request run alone
  (greedy, `deterministic: true`, so equal by contract on any BLAS: on OpenBLAS a plain row's
  last bits depend on the rows beside it), and the server ends healthy with no request left
  running.
- `lockstep serve` as a real process: SIGTERM lets an in-flight stream finish whole,
  refuses new work with 503 meanwhile, and the process exits 0.
"""
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2 as httpx
import pytest
from openai import OpenAI

from tests.http_server import free_port, wait_for_health, wait_until

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = 16  # four times the live server's slots
MAX_TOKENS = 6
TOPICS = ["the sea", "a red apple", "winter mornings", "a lost key", "trains", "the moon", "coffee", "a small dog"]


def messages(topic):
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def stream(client, topic, hang_up=False):
    """(text, finish_reason, chunk ids) of one streamed chat; after one chunk if `hang_up`."""
    chunks = client.chat.completions.create(model="default", messages=messages(topic), max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"deterministic": True})
    text, finish, ids = "", None, set()
    for chunk in chunks:
        ids.add(chunk.id)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if hang_up:
            chunks.close()
            break
    return text, finish, ids


def test_concurrent_streams_are_whole_and_their_own(live_server):
    client = OpenAI(base_url=live_server, api_key="x", max_retries=0, timeout=600)
    health_url = live_server.removesuffix("/v1") + "/health"
    cancelled_before = httpx.get(health_url).json()["cancelled"]
    alone = {topic: stream(client, topic)[:2] for topic in TOPICS}
    assert len({text for text, _ in alone.values()}) == len(TOPICS)  # distinct answers: a mix-up would show

    results, errors = [None] * CLIENTS, []
    start = threading.Barrier(CLIENTS)

    def run(i):
        try:
            start.wait()
            results[i] = stream(client, TOPICS[i % len(TOPICS)], hang_up=i % 4 == 3)
        except Exception as exc:  # reported below, with the client's index
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and all(not t.is_alive() for t in threads)

    for i, (text, finish, ids) in enumerate(results):
        assert len(ids) == 1  # every chunk of a stream carries that stream's id
        if i % 4 != 3:
            assert (text, finish) == alone[TOPICS[i % len(TOPICS)]], i
    assert len({next(iter(ids)) for _, _, ids in results}) == CLIENTS

    wait_until(lambda: httpx.get(health_url).json()["active"] == 0, timeout=300, what="all slots free")
    health = httpx.get(health_url).json()
    assert health["status"] == "ok" and health["waiting"] == 0
    assert 0 <= health["cancelled"] - cancelled_before <= CLIENTS // 4
    assert stream(client, TOPICS[0])[:2] == alone[TOPICS[0]]  # still serving correctly


# ------------------------------------------------------------------------- shutdown

@pytest.fixture
def serve_process(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.server.cli", "serve", "--port", str(port), "--drain-timeout", "120"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LOCKSTEP_API_KEYS": ""},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base, tmp_path / "serve.log")
        yield proc, base, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_sigterm_drains_the_stream_in_flight_then_exits_0(serve_process):
    proc, base, log = serve_process
    body = {"model": "default", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 24, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base, timeout=300) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(base + "/health").status_code == 503, what="draining")
        refused = httpx.post(base + "/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        events += [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert proc.wait(timeout=120) == 0
    log.seek(0)
    access = [json.loads(line) for line in log if line.startswith("{")]
    streamed = [a for a in access if a["path"] == "/v1/completions" and a["status"] == 200]
    assert len(streamed) == 1 and streamed[0]["completion_tokens"] == 24
    assert "1, 2, 3" not in "".join(json.dumps(a) for a in access)  # no prompt text by default
