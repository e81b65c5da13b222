"""Several models in one server (server/api/model_pool.py, assembled by server/commands/serve_models.py):
the official `openai` client against a live uvicorn for what HTTP shows (each model answers as a
server of its own would, idle unload and reload with the memory back, a 503 while loading, the
budget's least recently used unload), and the pool alone with stand-in engines for what a client
cannot hold still (a model with requests in flight is never unloaded)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib

import httpx2 as httpx
import mlx.core as mx
import pytest
from openai import InternalServerError, NotFoundError, OpenAI

from lockstep.server.api.errors import APIError
from lockstep.server.api.model_pool import LOADED, UNLOADED, LoadedService, ModelEntry, ModelPool
from tests.http_server import running, wait_until

PROMPT = "The capital of France is"
TINY_PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random-weight llama as an mlx-lm directory (mlx-lm's own class), with a word tokenizer."""
    from tests.synthetic import build_llama_dir, write_tiny_tokenizer

    out = build_llama_dir(tmp_path_factory.mktemp("tiny-llama"), hidden=128, intermediate=256, heads=4,
                          kv_heads=2, vocab=384)
    write_tiny_tokenizer(out, vocab=384)
    return out


@pytest.fixture(scope="module")
def tiny_bytes(tiny_dir):
    from lockstep.models.load import load_model
    from lockstep.server.commands.serve_models import weights_bytes

    return weights_bytes(load_model(str(tiny_dir)).model)


@contextlib.contextmanager
def pool_server(*argv: str):
    """`lockstep serve ARGV`'s app (the serve assembly itself) on a live loopback uvicorn.
    Yields (openai client, base url, pool)."""
    from lockstep.server.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    app, pool = serve.build_app_from_args(parser.parse_args(list(argv)))
    try:
        with running(app) as url:
            yield OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300), url, pool
    finally:
        pool.stop()


def complete(client: OpenAI, model: str, prompt, max_tokens: int = 6, served_as: str | None = None) -> list[int]:
    """A greedy completion's token ids (the response names the model as `served_as`, when given)."""
    response = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert served_as is None or response.model == served_as
    return response.choices[0].model_extra["lockstep"]["token_ids"]


def states(url: str) -> dict[str, dict]:
    return {card["id"]: card["lockstep"] for card in httpx.get(url + "/v1/models").json()["data"]}


def test_two_models_answer_as_their_own_servers(live_server, tiny_dir):
    from lockstep.models.load import load_model
    from lockstep.server.api.app import create_app
    from lockstep.server.engine import Engine

    alone = OpenAI(base_url=live_server, api_key="x", max_retries=0)
    smol_alone = complete(alone, "default", PROMPT)
    engine = Engine(load_model(str(tiny_dir)), max_active=2).start()
    try:
        with running(create_app(engine)) as url:
            tiny_alone = complete(OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), "default", TINY_PROMPT)
    finally:
        engine.stop()

    with pool_server("--model", "smol=default", "--model", f"tiny={tiny_dir}") as (client, url, pool):
        listed = states(url)
        assert set(listed) == {"smol", "smol:deterministic", "tiny", "tiny:deterministic"}
        assert listed["smol"]["state"] == listed["tiny"]["state"] == UNLOADED  # loaded on demand
        assert complete(client, "tiny", TINY_PROMPT, served_as="tiny") == tiny_alone
        assert complete(client, "smol", PROMPT, served_as="smol") == smol_alone
        assert complete(client, "default", PROMPT, served_as="smol") == smol_alone  # the first model
        assert complete(client, "tiny:deterministic", TINY_PROMPT, served_as="tiny") == tiny_alone
        listed = states(url)
        for name in ("smol", "tiny"):
            assert listed[name]["state"] == LOADED and listed[name]["loads"] == 1
            # each its own runtime: its own audit and guarantee
            assert listed[name]["batch_invariance"]["state"] == "off" and "audit" in listed[name]
        assert listed["tiny"]["context_length"] == 2048 != listed["smol"]["context_length"]
        assert listed["tiny:deterministic"]["deterministic_by_name"] is True
        assert client.models.retrieve("tiny").id == "tiny"
        assert client.responses.create(model="smol", input="Say hi", max_output_tokens=3).model == "smol"
        counted = httpx.post(url + "/v1/messages/count_tokens",
                             json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        with pytest.raises(NotFoundError) as missing:
            client.completions.create(model="nope", prompt="x", max_tokens=1)
        assert missing.value.body["code"] == "model_not_found"
        health = httpx.get(url + "/health").json()
        assert health["models"]["tiny"]["state"] == LOADED and health["models"]["smol"]["guarantee"] == "off"
        metrics = httpx.get(url + "/metrics").text
        assert 'lockstep_model_state{model="tiny",state="loaded"} 1.0' in metrics
        # summed over the loaded engines (the CPU builds no pass ahead: the reference pool)
        assert 'lockstep_decode_ahead_passes_total{outcome="built"} 0.0' in metrics


def test_idle_model_unloads_with_its_memory_back_and_reloads_on_demand(tiny_dir):
    with pool_server("--model", "smol=default", "--idle-unload", "0.2") as (client, url, pool):
        first = complete(client, "smol", PROMPT)
        loaded = mx.get_active_memory()
        weights = states(url)["smol"]["weights_bytes"]
        # `unloads` counts an unload once its memory is back
        wait_until(lambda: states(url)["smol"]["unloads"] == 1, timeout=60, what="the idle unload")
        assert states(url)["smol"]["state"] == UNLOADED
        freed = loaded - mx.get_active_memory()
        assert freed >= 0.9 * weights, (freed, weights)
        assert complete(client, "smol", PROMPT) == first
        assert states(url)["smol"]["loads"] == 2


def test_request_for_a_loading_model_gets_503_with_retry_after(tiny_dir):
    with pool_server("--model", f"tiny={tiny_dir}", "--model", "other=default", "--load-timeout", "0") \
            as (client, url, pool):
        with pytest.raises(InternalServerError) as loading:
            complete(client, "tiny", TINY_PROMPT)
        assert loading.value.status_code == 503
        assert loading.value.body["code"] == "model_loading" and loading.value.body["param"] == "model"
        assert int(loading.value.response.headers["retry-after"]) > 0
        wait_until(lambda: states(url)["tiny"]["state"] == LOADED, timeout=60, what="the load")
        assert len(complete(client, "tiny", TINY_PROMPT)) == 6


def test_budget_unloads_the_least_recently_used_idle_model(tiny_dir, tiny_bytes):
    budget = str(2 * tiny_bytes + tiny_bytes // 2)  # room for two
    args = [arg for name in "abc" for arg in ("--model", f"{name}={tiny_dir}")]
    with pool_server(*args, "--models-memory-bytes", budget) as (client, url, pool):
        for name in ("a", "b", "a"):  # b is now the least recently used
            complete(client, name, TINY_PROMPT, max_tokens=2)
        complete(client, "c", TINY_PROMPT, max_tokens=2)
        listed = states(url)
        assert [listed[n]["state"] for n in "abc"] == [LOADED, UNLOADED, LOADED]
        assert listed["b"]["unloads"] == 1 and listed["a"]["unloads"] == 0


# ----------------------------------------------------------------- the pool alone

class StandInEngine:
    """An engine's counts and guarantee, no model: `active` requests in flight."""

    def __init__(self):
        self.active = 0
        self.stopped = False
        self.guarantee = type("G", (), {"state": "off"})()
        self.ahead = {"built": 0, "taken": 0, "dropped": 0}

    def counts(self):
        return {"active": self.active, "waiting": 0, "cancelled": 0}

    def decode_ahead_counts(self):
        return dict(self.ahead)

    def stop(self):
        self.stopped = True


def stand_in_pool(names, budget, clock=None, idle=None):
    engines = {}

    def load(entry):
        engines[entry.name] = StandInEngine()
        return LoadedService(engine=engines[entry.name], info=dict, nbytes=100)

    pool = ModelPool([ModelEntry(n) for n in names], load, lambda service: service.engine.stop(),
                     budget_bytes=budget, idle_unload_s=idle, **({"clock": clock} if clock else {}))
    return pool, engines


async def use(pool, name):
    async with pool.use(name):
        pass


def test_a_model_with_requests_in_flight_is_never_unloaded():
    pool, engines = stand_in_pool(["a", "b"], budget=150)
    asyncio.run(use(pool, "a"))
    engines["a"].active = 1  # a request of a's is generating
    with pytest.raises(APIError) as busy:
        asyncio.run(use(pool, "b"))
    assert busy.value.status == 503 and busy.value.body.code == "model_memory_busy"
    assert busy.value.headers["Retry-After"]
    assert pool.models["a"].state == LOADED and not engines["a"].stopped
    engines["a"].active = 0  # it finished: now a makes room for b
    asyncio.run(use(pool, "b"))
    assert engines["a"].stopped and pool.models["a"].state == UNLOADED and pool.models["b"].state == LOADED


def test_decode_ahead_counts_never_fall_when_a_model_unloads():
    """/metrics' decode-ahead counters are the pool's sums: an unloaded model's passes stay
    counted (a Prometheus counter never falls)."""
    pool, engines = stand_in_pool(["a", "b"], budget=150)
    asyncio.run(use(pool, "a"))
    engines["a"].ahead = {"built": 5, "taken": 4, "dropped": 1}
    asyncio.run(use(pool, "b"))  # a unloads to make room
    engines["b"].ahead = {"built": 2, "taken": 2, "dropped": 0}
    assert pool.models["a"].state == UNLOADED
    assert pool.decode_ahead_counts() == {"built": 7, "taken": 6, "dropped": 1}


def test_idle_unload_skips_a_busy_model_and_counts_idle_time_from_its_last_request():
    now = [0.0]
    pool, engines = stand_in_pool(["a"], budget=None, clock=lambda: now[0], idle=10.0)
    asyncio.run(use(pool, "a"))
    engines["a"].active = 1
    now[0] = 50.0
    assert pool.unload_idle() == 0  # busy: never unloaded, and its idle time starts again
    engines["a"].active = 0
    now[0] = 55.0
    assert pool.unload_idle() == 0
    now[0] = 60.0
    assert pool.unload_idle() == 1 and engines["a"].stopped and pool.models["a"].unloads == 1


def test_a_model_that_fails_to_load_is_a_clear_error_and_the_others_serve(tiny_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    with pool_server("--model", f"tiny={tiny_dir}", "--model", f"broken={missing}") as (client, url, pool):
        with pytest.raises(InternalServerError) as failed:
            complete(client, "broken", TINY_PROMPT)
        assert failed.value.status_code == 500 and failed.value.body["code"] == "model_load_failed"
        assert str(missing) in failed.value.body["message"]
        assert states(url)["broken"]["state"] == UNLOADED and "load_problem" in states(url)["broken"]
        assert len(complete(client, "tiny", TINY_PROMPT)) == 6
