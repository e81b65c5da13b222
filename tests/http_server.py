"""Run an ASGI app on uvicorn on a free loopback port, on a background thread."""
import contextlib
import socket
import threading
import time
from pathlib import Path

import uvicorn


@contextlib.contextmanager
def running(app):
    """Yields the base URL ("http://127.0.0.1:PORT"); stops the server on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc, base: str, log_path, timeout: float = 300.0) -> None:
    """Wait until a `lockstep serve` subprocess answers /health; fails with its log if it exits."""
    import httpx2 as httpx

    def up():
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        try:
            return httpx.get(base + "/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, timeout=timeout, what="lockstep serve to start")


def wait_until(predicate, timeout=60.0, what="condition"):
    """Poll `predicate` until true; fails (not a timing assertion: a hang guard) after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
