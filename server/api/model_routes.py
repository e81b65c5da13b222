"""The model listing and health routes (`/v1/models`, `/v1/models/{id}`, `/health`): of a
single-model server (its one `Submissions`), or of a `ModelPool`'s several models, each listed with
its state and load counts and, while loaded, its own card. Every model is listed twice: as
itself and by its `:deterministic` name."""
from __future__ import annotations

import time
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lockstep.server.api.response_bodies import ModelCard, ModelList
from lockstep.server.api.model_pool import DETERMINISTIC_SUFFIX, ModelPool
from lockstep.server.api.submission import Submissions


def current_extras(extras: dict | Callable[[], dict] | None) -> dict:
    """/v1/models' extra details; a function gives those that change (the guarantee's state)."""
    return (extras() if callable(extras) else extras) or {}


def model_card(submissions: Submissions, extras: dict | Callable[[], dict] | None) -> ModelCard:
    """A loaded model's card: its weights, context, batching, and `extras`."""
    extras = current_extras(extras)
    info = {"weights": submissions.loaded.weights, "context_length": submissions.loaded.context_length,
            "batching": submissions.engine.describe()}
    return ModelCard(id=submissions.name, created=submissions.created, lockstep={**info, **extras})


def deterministic_card(card: ModelCard) -> ModelCard:
    """`card` as its `:deterministic` name lists it."""
    return card.model_copy(update={"id": card.id + DETERMINISTIC_SUFFIX,
                                   "lockstep": {**card.lockstep, "deterministic_by_name": True}})


def pool_cards(pool: ModelPool, model, created: int) -> tuple[ModelCard, ModelCard]:
    """A pooled model's /v1/models entries, plain and `:deterministic`: its state and load counts,
    and, while loaded, its own details (audit, guarantee, batching) as a single-model server
    lists them."""
    service = model.service
    status = pool.status(model)
    details = {"state": status["state"], "loads": status["loads"], "unloads": status["unloads"],
               **({"weights_bytes": status["weights_bytes"]} if "weights_bytes" in status else {}),
               **({"load_problem": status["load_problem"]} if "load_problem" in status else {}),
               **({"default": True} if model.name == pool.default else {})}
    if service is not None and service.submissions is not None:
        card = model_card(service.submissions, service.info)
        card = card.model_copy(update={"lockstep": {**details, **card.lockstep}})
    else:
        card = ModelCard(id=model.name, created=created, lockstep=details)
    return card, deterministic_card(card)


def install_model_routes(app: FastAPI, submissions: Submissions, model_extras) -> None:
    """The routes of one model: `submissions` is its `Submissions`, `model_extras` what its card adds."""
    engine = submissions.engine

    @app.get("/v1/models")
    async def list_models():
        card = model_card(submissions, model_extras)
        return JSONResponse(ModelList(data=[card, deterministic_card(card)]).model_dump())

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes ("org/name")
    async def retrieve_model(model_id: str):
        # the served model's name or the alias "default", either with the deterministic suffix; else 404
        submissions.check_model(model_id)
        card = model_card(submissions, model_extras)
        if model_id.endswith(DETERMINISTIC_SUFFIX):
            card = deterministic_card(card)
        return JSONResponse(card.model_dump())

    @app.head("/health", include_in_schema=False)  # load balancers often probe with HEAD
    @app.get("/health")
    async def health():
        if engine.failure is not None:  # its worker stopped: nothing is served, the server is stopping
            return JSONResponse({"status": "failed", "model": engine.loaded.name, "error": engine.failure},
                                status_code=503)
        batching = engine.describe()
        return {"status": "ok", "model": engine.loaded.name, "guarantee": engine.guarantee.state,
                **engine.counts(), "audited_rows": engine.audited.describe()["audited_rows"],
                # the widest pass deterministic rows may share now (grows while a ragged proof goes on)
                "deterministic_pass_rows": batching["deterministic_pass_rows"],
                # the widest block their rows are sampled in, the others the powers of two below it
                # (0 until the batched-sampling proof ran)
                "deterministic_sampling_rows": batching["deterministic_sampling_rows"],
                "starting": engine.starting}


def install_pool_model_routes(app: FastAPI, pool: ModelPool) -> None:
    """The routes of a pool's several models (server/api/model_pool.py): each listed whether
    loaded or not; /health reports every model's state."""
    created = int(time.time())

    @app.get("/v1/models")
    async def list_models():
        cards = [card for model in pool.models.values() for card in pool_cards(pool, model, created)]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        plain, deterministic = pool_cards(pool, pool.find(model_id), created)
        return JSONResponse((deterministic if model_id.endswith(DETERMINISTIC_SUFFIX) else plain).model_dump())

    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health():
        default = pool.models[pool.default]
        failure = pool.failure
        if failure is not None:
            return JSONResponse({"status": "failed", "model": pool.default, "error": failure}, status_code=503)
        return {"status": "ok", "model": pool.default,
                # "proving" while any loaded model proves, so a caller waiting for it sees it
                "guarantee": "proving" if pool.proving() else pool.status(default)["guarantee"] or default.state,
                **pool.counts(), "models": {m.name: pool.status(m) for m in pool.models.values()}}
