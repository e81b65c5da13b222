"""server/api/drain.py: a deterministic request waiting for the guarantee's proof (proven after
serving starts) gets a 503 in OpenAI's shape the moment draining starts, and the drain does not
wait for it (it used to wait the whole drain timeout, then the client got a plain-text 500)."""
import signal
import threading

import openai
import pytest
from openai import OpenAI

from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import wait_until
from tests.test_hardening_round2 import EndlessGenerate

DRAIN_TIMEOUT_S = 120  # far longer than the test may take: the drain must end without it


def test_a_request_waiting_for_the_proof_gets_503_when_draining_starts(embedded_model, caplog):
    from lockstep.server.api.app import create_app
    from lockstep.server.api.shutdown import bind, draining_server
    from lockstep.server.engine.guarantee.guarantee_state import PROVING, GuaranteeState

    engine = ScriptedEngine(embedded_model, EndlessGenerate(), guarantee=GuaranteeState(PROVING)).start()
    sock = bind("127.0.0.1", 0)
    server = draining_server(create_app(engine, guarantee_timeout=600), "127.0.0.1", sock.getsockname()[1],
                             drain_timeout=DRAIN_TIMEOUT_S, log_level="warning", lifespan="off")
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    wait_until(lambda: server.started, what="uvicorn")
    client = OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0, timeout=300)
    outcome = {}

    def deterministic():
        try:
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, extra_body={"deterministic": True})
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    waiting = threading.Thread(target=deterministic)
    try:
        waiting.start()
        wait_until(lambda: engine.guarantee._waiters, what="the request to wait for the proof")
        server.handle_exit(signal.SIGTERM, None)
        waiting.join(timeout=60)
        serving.join(timeout=60)  # the drain ends as the request does, not at its timeout
        assert not waiting.is_alive() and not serving.is_alive()
    finally:
        engine.stop()
    error = outcome["error"]
    assert error.status_code == 503
    assert error.body["code"] == "server_shutting_down" and error.body["type"] == "server_error"
    assert not [r for r in caplog.records if r.exc_info]
