"""server/engine/engine.py: an error beyond one request (the device failing: on CUDA a sticky
"illegal memory access" fails every call after it) ends the engine's loop. Its requests then
fail at once in OpenAI's shape, /health answers 503 "failed", new requests get a 503, and the
server stops by itself (`serve` exits 1, which launchd restarts), where it used to answer
/health 200 while every request waited for ever."""
import threading

import httpx
import openai
import pytest
from openai import OpenAI

from tests.http_server import running, wait_until

DEVICE_ERROR = "cudaMallocAsync failed: an illegal memory access was encountered"


def _failing_engine(embedded_model):
    from lockstep.server.engine import Engine

    engine = Engine(embedded_model, max_active=2)

    def device_fails():
        raise RuntimeError(DEVICE_ERROR)

    engine.scheduler.schedule_prefill = device_fails
    return engine.start()


def test_an_engine_error_fails_its_requests_and_stops_the_server(embedded_model):
    from lockstep.server.api.app import create_app
    from lockstep.server.api.shutdown import bind, draining_server

    engine = _failing_engine(embedded_model)
    sock = bind("127.0.0.1", 0)
    server = draining_server(create_app(engine), "127.0.0.1", sock.getsockname()[1], drain_timeout=120,
                             failure=lambda: engine.failure, log_level="warning", lifespan="off")
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    serving.start()
    try:
        wait_until(lambda: server.started, what="uvicorn")
        client = OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x",
                        max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
        assert DEVICE_ERROR in failed.value.body["message"] and failed.value.body["type"] == "server_error"
        serving.join(timeout=60)  # stops by itself: no signal, and long before the drain's timeout
        assert not serving.is_alive()
        assert server.failed is not None and DEVICE_ERROR in server.failed
    finally:
        engine.stop()


def test_health_says_the_engine_failed(embedded_model):
    from lockstep.server.api.app import create_app

    engine = _failing_engine(embedded_model)
    try:
        with running(create_app(engine)) as url:
            assert httpx.get(url + "/health").status_code == 200
            client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
            with pytest.raises(openai.InternalServerError):
                client.completions.create(model="default", prompt="hi", max_tokens=2)
            wait_until(lambda: engine.failure is not None, what="the engine to fail")
            health = httpx.get(url + "/health")
            assert health.status_code == 503
            assert health.json()["status"] == "failed" and DEVICE_ERROR in health.json()["error"]
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="default", prompt="hi", max_tokens=2)
            assert refused.value.status_code == 503 and "engine stopped after an error" in refused.value.message
    finally:
        engine.stop()


def _work_fails(engine, times: int):
    """The engine's next `times` pieces of work (a prompt chunk alone or shared, a decode pass) raise."""
    left = [times]
    for name in ("prefill", "prefill_shared", "run_pass"):
        real = getattr(engine.runner, name)

        def failing(*args, real=real, **kwargs):
            if left[0] > 0:
                left[0] -= 1
                raise RuntimeError("this request's work failed")
            return real(*args, **kwargs)

        setattr(engine.runner, name, failing)


@pytest.mark.parametrize("device_fails", [False, True])
def test_failed_work_ends_the_engine_only_where_the_device_fails_too(embedded_model, monkeypatch, device_fails):
    """Work that failed alone fails its request and the engine goes on (the negative control); where
    the device then runs nothing either (a sticky CUDA error), the engine ends."""
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.engine.runner import model_runner

    if device_fails:
        monkeypatch.setattr(model_runner, "check_device", lambda: (_ for _ in ()).throw(RuntimeError(DEVICE_ERROR)))
    engine = Engine(embedded_model, max_active=2)
    _work_fails(engine, 1)
    engine.start()
    try:
        with running(create_app(engine)) as url:
            client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
            with pytest.raises(openai.InternalServerError) as failed:
                client.completions.create(model="default", prompt="hi", max_tokens=2)
            if device_fails:
                assert DEVICE_ERROR in failed.value.message
                wait_until(lambda: engine.failure is not None, what="the engine to fail")
                assert httpx.get(url + "/health").status_code == 503
            else:
                assert "this request's work failed" in failed.value.message
                answer = client.completions.create(model="default", prompt="hi", max_tokens=2)
                assert answer.choices[0].text is not None and engine.failure is None
                assert httpx.get(url + "/health").status_code == 200
    finally:
        engine.stop()
