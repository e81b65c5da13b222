"""server/api/connections.py: the connection cap and the header/body deadlines, on the real
`DrainingServer` (in-process, on a thread) over the real app with a scripted engine; and the
rate-limited line for accept failures. The same under a real file limit, with the official
client, is in tests/test_serve.py."""
import json
import logging
import socket
import threading

import httpx2 as httpx
import pytest

from tests.doubles.scripted_engine import ScriptedEngine
from tests.http_server import wait_until
from tests.test_hardening_round2 import CHAT, EndlessGenerate


@pytest.fixture(scope="module")
def endless():
    return EndlessGenerate()


@pytest.fixture(scope="module")
def engine(embedded_model, endless):
    engine = ScriptedEngine(embedded_model, endless, max_active=4).start()
    yield engine
    endless.gate.set()
    engine.stop()


@pytest.fixture
def serve(engine):
    """serve(**ConnectionLimits fields) -> (server, base URL); stopped at the test's end."""
    from lockstep.server.api.app import create_app
    from lockstep.server.api.connections import ConnectionLimits
    from lockstep.server.api.shutdown import bind, draining_server

    started = []

    def start(**limits):
        sock = bind("127.0.0.1", 0)
        server = draining_server(create_app(engine), "127.0.0.1", sock.getsockname()[1],
                                 connections=ConnectionLimits(**limits), log_level="warning", lifespan="off")
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        started.append((server, thread))
        wait_until(lambda: server.started, what="uvicorn")
        return server, f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in started:
        server.should_exit = True
        thread.join(timeout=30)


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed `sock` (EOF after whatever it sent); a hang guard of 30 s."""
    try:
        while chunk := sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_connections_without_whole_headers_are_closed_at_the_header_timeout(serve):
    server, base = serve(header_timeout=0.3)
    idle = connect(base)
    partial = connect(base)
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    assert closed_by_server(idle) and closed_by_server(partial)
    assert sum(n for kind, n in server.guard.counts.items() if "headers" in kind) == 2
    assert httpx.get(base + "/health").status_code == 200  # a prompt client is not affected


def test_a_body_that_does_not_arrive_in_time_gets_408_in_openai_shape(serve, caplog):
    server, base = serve(body_timeout=0.3)
    body = json.dumps(CHAT).encode()
    slow = connect(base)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    answer = b""
    while chunk := slow.recv(65536):
        answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    error = json.loads(payload)["error"]
    assert error["code"] == "request_timeout" and set(error) == {"message", "type", "param", "code"}
    wait_until(lambda: not server.server_state.tasks, what="the request's task to end")
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(serve):
    server, base = serve(keep_alive_timeout=0.3, header_timeout=60)
    kept = connect(base)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    kept.settimeout(3)  # below uvicorn's own default of 5 s: the flag's value must be the one in force
    assert closed_by_server(kept)


def test_at_the_cap_the_least_recently_active_idle_connection_makes_room(serve):
    server, base = serve(max_connections=3, header_timeout=60)
    idle = [connect(base) for _ in range(3)]
    wait_until(lambda: len(server.guard.open) == 3, what="three connections held")
    assert httpx.get(base + "/health").status_code == 200  # a fourth: the oldest idle one makes room
    assert closed_by_server(idle[0])
    for sock in idle[1:]:
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # still open: nothing to read, no EOF
            sock.recv(1)
    assert server.guard.counts == {"idle connections closed at the cap of 3": 1}


def test_when_every_connection_is_being_answered_a_new_one_gets_503(serve, endless):
    server, base = serve(max_connections=2)
    endless.gate.clear()  # the two streams stay open, being answered
    streams = []
    try:
        for _ in range(2):
            client = httpx.Client(base_url=base, timeout=30)
            response = client.send(client.build_request("POST", "/v1/chat/completions",
                                                        json={**CHAT, "stream": True, "max_tokens": 5}), stream=True)
            streams.append((client, response))
        refused = httpx.get(base + "/health")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_connections"
    finally:
        endless.gate.set()
        for client, response in streams:
            response.read()
            client.close()


def test_accept_failures_log_one_line_not_one_per_failure(serve, caplog):
    import errno

    from lockstep.server.api.connections import ACCEPT_FAILED

    server, _ = serve()
    loop = server.servers[0].get_loop()
    failure = {"message": ACCEPT_FAILED, "exception": OSError(errno.EMFILE, "Too many open files")}
    done = threading.Event()

    def fail_many():  # as asyncio does: once per queued connection, every second, while descriptors run out
        for _ in range(2000):
            loop.call_exception_handler(failure)
        done.set()

    caplog.set_level(logging.WARNING)
    loop.call_soon_threadsafe(fail_many)
    assert done.wait(30)
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage() and not lines[0].exc_info
