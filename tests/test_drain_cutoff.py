"""Finding 4 of the second adversarial probe: requests still running at the drain timeout (or
a second signal) are cut off cleanly — each stream ends with an SSE error event and [DONE],
a non-streamed request gets 503, and the log has one line per cut request, no traceback.
"""
import json
import logging
import threading

import httpx2 as httpx
import pytest

from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import wait_until
from tests.test_hardening_round2 import CHAT, EndlessGenerate

def _serve_draining(app, drain_timeout):
    from lockstep.server.api.shutdown import DrainingServer, bind

    import uvicorn

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2), app.state.drain, drain_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="uvicorn")
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("second_signal", [False, True])
def test_streams_cut_at_the_drain_timeout_end_with_an_error_event_and_done(embedded_model, caplog,
                                                                          second_signal):
    import signal

    from lockstep.server.api.app import create_app

    endless = EndlessGenerate()
    engine = ScriptedEngine(embedded_model, endless).start()
    app = create_app(engine)
    server, thread, url = _serve_draining(app, drain_timeout=60 if second_signal else 0.5)
    bodies, statuses = {}, {}

    def stream(i):
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 99},
                          timeout=60) as r:
            bodies[i] = r.read().decode()

    def plain():
        statuses["plain"] = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 99}, timeout=60)

    caplog.set_level(logging.WARNING)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)] + [threading.Thread(target=plain)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: engine.counts()["active"] == 3, what="three requests running")
        server.handle_exit(signal.SIGTERM, None)
        if second_signal:
            server.handle_exit(signal.SIGTERM, None)
        for t in threads:
            t.join(timeout=30)
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        engine.stop()
    for body in bodies.values():
        events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert len(bodies) == 2
    assert statuses["plain"].status_code == 503
    assert statuses["plain"].json()["error"]["code"] == "server_shutting_down"
    cut_lines = [r for r in caplog.records if "cut off:" in r.getMessage()]
    assert len(cut_lines) == 3  # one line per cut request
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]


