"""Shared fixtures: the embedded model is loaded once per test session (2-core CI)."""
import pytest


@pytest.fixture(scope="session")
def embedded_model():
    from models.load import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def live_server(embedded_model):
    """The API on a free loopback port: in-process uvicorn on a background thread.

    Yields the base URL ("http://127.0.0.1:PORT/v1"), for the official `openai` client.
    """
    import socket
    import threading
    import time

    import uvicorn

    from server.app import create_app
    from server.engine import Engine

    engine = Engine(embedded_model, max_active=4).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the port is held from here on: no race with other tests
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(engine), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=30)
    engine.stop()
    sock.close()
