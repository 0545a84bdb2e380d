"""The FastAPI app: routes, error handlers, CORS, API key and body-size middleware.

`build_app(engine, settings)` wires an AsyncEngine (started and stopped by the app's lifespan) to the
OpenAI-compatible routes. Every refusal is an OpenAI-shaped error (see errors.py).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import fitserve
from fitserve.engine.async_engine import AsyncEngine, EngineUnavailableError
from fitserve.server.args import ServerSettings
from fitserve.server.context import ServingContext
from fitserve.server.errors import APIError, api_error_handler, validation_error_handler
from fitserve.server.metrics import ServerMetrics
from fitserve.server.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from fitserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from fitserve.server.request_log import log_finished_request
from fitserve.server.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from fitserve.server.serving_chat import ChatHandler
from fitserve.server.serving_completion import CompletionHandler
from fitserve.server.streaming import ClientDisconnected

logger = logging.getLogger(__name__)

ROUTES = (
    "GET /health",
    "GET /ping",
    "GET /version",
    "GET /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /tokenize",
    "POST /detokenize",
    "GET /metrics",
)


def fitserve_version() -> str:
    version = getattr(fitserve, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version("fitserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def _http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    if exc.status_code == HTTPStatus.NOT_FOUND and message == "Not Found":
        message = "no such route: see GET /openapi.json for the routes this server has"
    elif exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
        message = f"method not allowed on this route ({message}): see GET /openapi.json"
    return APIError(message, exc.status_code).to_response()


async def _engine_unavailable_handler(_: Request, exc: Exception) -> JSONResponse:
    return APIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE).to_response()


async def _client_disconnected_handler(_: Request, exc: Exception) -> Response:
    # Nobody reads this response: the client is gone and its requests were aborted.
    return Response(status_code=499)


async def _internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed", exc_info=exc)
    return APIError(f"internal error: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR).to_response()


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    ctx = ServingContext.create(engine, settings)
    metrics = ServerMetrics(ctx.model_name, engine.get_stats)
    engine.observers.append(metrics.observe)
    if not settings.disable_log_requests:
        engine.observers.append(log_finished_request)
    chat_handler = ChatHandler(ctx)
    completion_handler = CompletionHandler(ctx)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    docs = not settings.disable_fastapi_docs
    app = FastAPI(
        title="fitserve",
        version=fitserve_version(),
        description="OpenAI-compatible LLM server",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.add_middleware(BodySizeLimitMiddleware, limit=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.allowed_origins,
        allow_methods=settings.allowed_methods,
        allow_headers=settings.allowed_headers,
        allow_credentials=settings.allow_credentials,
    )
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(EngineUnavailableError, _engine_unavailable_handler)
    app.add_exception_handler(ClientDisconnected, _client_disconnected_handler)
    app.add_exception_handler(Exception, _internal_error_handler)

    def health_response() -> Response:
        if not engine.is_healthy:
            return APIError("the engine is not running", HTTPStatus.SERVICE_UNAVAILABLE).to_response()
        return Response(status_code=HTTPStatus.OK)

    @app.get("/health", summary="200 while the engine runs, 503 otherwise")
    async def health() -> Response:
        return health_response()

    @app.api_route("/ping", methods=["GET", "POST"], summary="Same as /health")
    async def ping() -> Response:
        return health_response()

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=fitserve_version())

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [
            ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
            for name in ctx.served_model_names
        ]
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat_handler.create(request, raw_request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion_handler.create(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(request.model)
        if request.messages is not None:
            _, ids = await ctx.render_chat(request, bool(request.add_special_tokens))
        else:
            add_special = request.add_special_tokens is not False
            ids = await asyncio.to_thread(ctx.tokenize, request.prompt or "", add_special)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(request.model)
        vocab_size = engine.config.model.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                f"tokens holds {bad}, outside the vocabulary [0, {vocab_size}): send ids this model's "
                "tokenizer produced",
                param="tokens",
            )
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(request.tokens))

    @app.get("/metrics", summary="Prometheus metrics (fitserve:* names)")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    return app
