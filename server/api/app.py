"""The HTTP app: `create_app` wires one model (`OneModel`) or a `ModelPool`'s models to the routes
(/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models, /health,
/metrics) behind the middleware (body size, auth, draining, request records, Retry-After).

A route names its model (`models.use(body.model)`: the model's `Submissions`, submission.py) and
hands the request to its endpoint's module: chat.py, completions.py, responses.py, messages.py;
model_routes.py lists the models.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response

from lockstep.server.api.access_log import AccessLog
from lockstep.server.api.auth import APIKeyAuth
from lockstep.server.api.chat import chat_completion
from lockstep.server.api.chat_protocol import ChatCompletionRequest
from lockstep.server.api.completions import text_completion
from lockstep.server.api.completions_protocol import CompletionRequest
from lockstep.server.api.drain import Drain, DrainMiddleware
from lockstep.server.api.errors import RetryAfter, install_error_handlers
from lockstep.server.api.grammar_checks import GrammarChecks
from lockstep.server.api.limits import BodySizeLimit, Limits
from lockstep.server.api.messages import MessagesRoute
from lockstep.server.api.metrics import Metrics
from lockstep.server.api.model_pool import ModelPool
from lockstep.server.api.model_routes import current_extras, install_model_routes, install_pool_model_routes
from lockstep.server.api.recorder import Recorder
from lockstep.server.api.request_record import RecordRequests
from lockstep.server.api.responses import ResponsesRoute
from lockstep.server.api.responses_protocol import ResponsesRequest
from lockstep.server.api.submission import DEFAULT_GUARANTEE_TIMEOUT_S, Submissions
from lockstep.server.engine import Engine

SHUTTING_DOWN = "the server is shutting down; this request was cut off"


class OneModel:
    """The one model of a single-model server, behind the interface a `ModelPool` has."""

    def __init__(self, submissions: Submissions):
        self.submissions = submissions

    @contextlib.asynccontextmanager
    async def use(self, name: str):
        self.submissions.check_model(name)
        yield self.submissions


def create_app(
    engine: Engine | None = None,
    *,
    pool: ModelPool | None = None,
    model_extras: dict | Callable[[], dict] | None = None,
    fingerprint: str | None = None,
    api_keys: Sequence[str] = (),
    limits: Limits = Limits(),
    log_prompts: bool = False,
    guarantee_timeout: float = DEFAULT_GUARANTEE_TIMEOUT_S,
    deterministic_by_default: bool = False,
    record_dir: str | None = None,
) -> FastAPI:
    """The HTTP app for `engine`'s model, or for the models of `pool` (each its own engine, loaded
    on demand: server/api/model_pool.py; each model's details are then its `info`). `model_extras`
    (or what it returns, when a function) is added to the one model's /v1/models entry;
    `fingerprint` (default: the deployment's) is every response's system_fingerprint.

    `api_keys` (empty: auth off) guard /v1 and /metrics; `limits` caps bodies, tokens and
    the queue; prompts appear in the access log only with `log_prompts`; a deterministic request
    waits at most `guarantee_timeout` seconds for a guarantee still being proven;
    `deterministic_by_default`: requests that do not send `deterministic` are deterministic;
    `record_dir`: each answered request is appended there (server/api/recorder.py).
    """
    drain = Drain()
    recorder = Recorder(record_dir) if record_dir else None
    app = FastAPI(title="lockstep", docs_url=None, redoc_url=None)
    app.state.drain = drain
    metrics = Metrics()
    if pool is None:
        submissions = Submissions(engine, fingerprint, limits, log_prompts, guarantee_timeout, drain,
                                  deterministic_by_default, recorder)
        models = OneModel(submissions)
        app.state.engine = engine
        metrics.watch_engine(engine)
        metrics.watch_startup(lambda: current_extras(model_extras).get("startup", {}), engine.guarantee)
        engine.max_waiting = limits.max_queue
        app.state.drain.on_cut.append(lambda: engine.cut_off(SHUTTING_DOWN))
    else:
        grammar_checks = GrammarChecks(limits.grammar_workers, limits.grammar_queue)  # one pool for every model

        def make_submissions(service, name: str) -> Submissions:
            service.engine.max_waiting = limits.max_queue
            return Submissions(service.engine, fingerprint, limits, log_prompts, guarantee_timeout, drain,
                               deterministic_by_default, recorder, name=name, grammar_checks=grammar_checks)

        pool.make_submissions = make_submissions
        models = pool
        app.state.pool = pool
        metrics.watch_pool(pool)
        app.state.drain.on_cut.append(lambda: sum(e.cut_off(SHUTTING_DOWN) for e in pool.loaded_engines()))
    install_error_handlers(app)
    # Added innermost first: Retry-After -> record (log, metrics) -> drain -> auth -> body size -> routes.
    app.add_middleware(BodySizeLimit, limit=limits.max_body_bytes)
    app.add_middleware(APIKeyAuth, keys=list(api_keys))
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(RecordRequests, sinks=[AccessLog(log_prompts), metrics])
    app.add_middleware(RetryAfter)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        async with models.use(body.model) as submissions:
            return await chat_completion(submissions, body, request.receive)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        async with models.use(body.model) as submissions:
            return await text_completion(submissions, body, request.receive)

    responses = ResponsesRoute(models)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create(body, request.receive)

    messages = MessagesRoute(models)

    @app.post("/v1/messages")  # Anthropic's Messages API (server/api/messages.py)
    async def create_message(request: Request):
        return await messages.create(await request.body(), request.receive)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        return await messages.count_tokens(await request.body())

    if pool is None:
        install_model_routes(app, submissions, model_extras)
    else:
        install_pool_model_routes(app, pool)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    metrics.endpoints = {route.path for route in app.routes}
    return app
