"""Shared fixtures: the embedded model is loaded once per test session (2-core CI)."""
import os
import tempfile

import pytest

# Startup verdicts (kernel audit, self-test proofs) of this session go to a temporary
# directory, never the user's cache; `lockstep serve` subprocesses inherit it.
os.environ["LOCKSTEP_VERDICT_CACHE_DIR"] = tempfile.mkdtemp(prefix="lockstep-test-verdicts-")


@pytest.fixture(scope="session")
def embedded_model():
    from lockstep.models.load import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def live_server(embedded_model):
    """The API on a free loopback port: in-process uvicorn on a background thread.

    Yields the base URL ("http://127.0.0.1:PORT/v1"), for the official `openai` client.
    """
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine
    from tests.http_server import running

    engine = Engine(embedded_model, max_active=4).start()
    try:
        with running(create_app(engine)) as url:
            yield f"{url}/v1"
    finally:
        engine.stop()


# The files that start servers or prove at startup, slowest first. `make test` runs them
# first on its xdist workers (--dist loadfile, collection order kept), so that neither worker
# ends the run alone on one of them.
SLOW_FILES_FIRST = (
    "test_deterministic_http.py", "test_distributed.py", "test_ragged_proof_resume.py",
    "test_prompt_cache_disk.py", "test_quant_modes.py", "test_structured_outputs.py", "test_startup.py",
    "test_activation_dtype.py", "test_replay.py", "test_api.py", "test_batching_openblas.py",
    "test_reliability.py", "test_replay_server.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected
