"""Run an ASGI app on uvicorn on a free loopback port, on a background thread."""
import contextlib
import dataclasses
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


def wait_for_health(proc, base: str, log_path, timeout: float = 300.0, guarantee: bool = True) -> None:
    """Wait until a `lockstep serve` subprocess answers /health (and, with `guarantee`, has
    settled its determinism guarantee and ended its start-up work: the proofs, of which the
    guarantee's widths grow, and a draft model); fails with its log if it exits."""
    import httpx2 as httpx

    def up():
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        try:
            response = httpx.get(base + "/health")
        except httpx.TransportError:
            return False
        health = response.json() if response.status_code == 200 else {}
        return response.status_code == 200 and not (guarantee and (health.get("guarantee") == "proving"
                                                                    or health.get("starting")))

    wait_until(up, timeout=timeout, what="lockstep serve to start")


def wait_until(predicate, timeout=60.0, what="condition"):
    """Poll `predicate` until true; fails (not a timing assertion: a hang guard) after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def with_sampling_proof(deployment, model, proofs=None):
    """`deployment` with the batched-sampling proof `serve` makes after its guarantee
    (server/startup_work.py SamplingWork), on the model's logits, for its widest shared pass."""
    import mlx.core as mx

    from lockstep.server.engine.decoding.sampling_proof import prove_batched_sampling

    guarantee = deployment.guarantee
    if not (guarantee.guaranteed and guarantee.shared_passes):
        return deployment
    logits = model(mx.array([[1]]))
    proof = prove_batched_sampling(logits.shape[-1], logits.dtype, guarantee.pass_rows, proof_cache=proofs)
    return dataclasses.replace(deployment, guarantee=dataclasses.replace(guarantee, sampling_rows=proof.rows))


@contextlib.contextmanager
def deterministic_server(loaded, limit: int, prefill_chunk: int = 4, max_active: int = 4, prefix_cache=None,
                         fingerprint: str = ""):
    """The API for `loaded` with batch invariance installed for L = `limit` (removed on exit,
    so other modules get the native model) and a prefix cache. The self-test and ragged
    proofs are kept in the session's verdict cache (tests/conftest.py), as a restarted
    server keeps them, so the next module's server re-uses them. `prefix_cache`: default an
    in-memory one of 4 entries; `fingerprint`: the deployment's (a disk tier keys by it).
    Yields (client, engine)."""
    from openai import OpenAI

    from lockstep.kernels.invariance import set_batch_invariant_limit
    from lockstep.kernels.invariance.selftest import ProofCache
    from lockstep.kernels.verdict_cache import VerdictCache
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from lockstep.server.engine.guarantee.deployment import proven_deployment
    from lockstep.server.engine.cache.prefix_cache import PrefixCache

    proofs = ProofCache(VerdictCache("selftest"), model_identity={"model": str(loaded.path), "weights": loaded.weights})
    invariance = set_batch_invariant_limit(loaded.model, limit, proof_cache=proofs)
    try:
        assert invariance.guaranteed, invariance.reason
        deployment = with_sampling_proof(
            proven_deployment(loaded.model, invariance, proofs=proofs, prefill_chunk=prefill_chunk), loaded.model, proofs)
        assert deployment.guarantee.shared_passes
        if fingerprint:
            deployment = dataclasses.replace(deployment, fingerprint=fingerprint)
        engine = Engine(loaded, max_active=max_active, deployment=deployment,
                        prefix_cache=prefix_cache if prefix_cache is not None else PrefixCache(4)).start()
        try:
            with running(create_app(engine)) as url:
                yield OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600), engine
        finally:
            engine.stop()
    finally:
        set_batch_invariant_limit(loaded.model, 0)
