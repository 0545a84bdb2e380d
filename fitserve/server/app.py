"""The FastAPI app: routes, error handlers, CORS, API key and body-size middleware.

`build_app(engine, settings)` wires an AsyncEngine (started and stopped by the app's lifespan) to the
OpenAI-compatible routes. Every refusal is an OpenAI-shaped error (see errors.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import fitserve
from fitserve.engine.async_engine import AsyncEngine, EngineUnavailableError
from fitserve.server.args import ServerSettings, load_middleware
from fitserve.server.context import ServingContext
from fitserve.server.errors import (
    APIError,
    ErrorResponse,
    api_error_handler,
    error_responses,
    validation_error_handler,
)
from fitserve.server.extras import (
    RequestIdHeaderMiddleware,
    RootPathMiddleware,
    ServerLoad,
    ServerLoadMiddleware,
    tokenizer_info,
)
from fitserve.server.metrics import ServerMetrics, cache_config_info
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
    "POST /invocations",
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
    allow = (exc.headers or {}).get("Allow") if exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED else None
    return APIError(message, exc.status_code, allow=allow).to_response()


async def _engine_unavailable_handler(_: Request, exc: Exception) -> JSONResponse:
    return APIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE).to_response()


async def _client_disconnected_handler(_: Request, exc: Exception) -> Response:
    # Nobody reads this response: the client is gone and its requests were aborted.
    return Response(status_code=499)


async def _internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed", exc_info=exc)
    message = f"internal error ({type(exc).__name__}); the server log has the details"
    return APIError(message, HTTPStatus.INTERNAL_SERVER_ERROR).to_response()


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    ctx = ServingContext.create(engine, settings)
    metrics = ServerMetrics(
        ctx.model_name,
        engine.get_stats,
        max_model_len=ctx.max_model_len,
        cache_info=cache_config_info(engine),
    )
    processor = getattr(engine.engine, "output_processor", None)
    if processor is not None:  # logprob tokens are decoded in the handlers, off the engine thread
        processor.decode_logprob_tokens = False
    engine.observers.append(metrics.observe)
    if not settings.disable_log_requests:
        engine.observers.append(functools.partial(log_finished_request, max_log_len=settings.max_log_len))
    for note in settings.accepted_no_ops():
        logger.info("%s", note)
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
    server_load = ServerLoad()
    app.state.server_load = server_load
    if settings.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=server_load)
    if settings.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if settings.root_path:
        app.add_middleware(RootPathMiddleware, root_path=settings.root_path)
    for path in settings.middleware:  # --middleware, as vLLM adds them: a class, else an HTTP function
        middleware = load_middleware(path)
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
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

    probe = {
        "response_class": Response,
        "responses": {200: {"description": "The engine runs (empty body)", "content": None}}
        | error_responses(503),
    }

    @app.get("/health", summary="200 while the engine runs, 503 otherwise", **probe)
    async def health() -> Response:
        return health_response()

    @app.get("/ping", summary="Same as /health", operation_id="ping_get", **probe)
    @app.post("/ping", summary="Same as /health", operation_id="ping_post", **probe)
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

    @app.post("/invocations", summary="SageMaker: a chat body (messages) or a completion body (prompt)")
    async def invocations(raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except ValueError as exc:
            raise APIError(f"the request body is not valid JSON: {exc}") from exc
        if isinstance(body, dict) and "messages" in body:
            model, handler = ChatCompletionRequest, chat_handler
        elif isinstance(body, dict) and "prompt" in body:
            model, handler = CompletionRequest, completion_handler  # type: ignore[assignment]
        else:
            raise APIError(
                "cannot tell the request type: send a chat body (messages) or a completion body (prompt)"
            )
        try:
            request = model.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc
        return await handler.create(request, raw_request)  # type: ignore[arg-type]

    if settings.enable_server_load_tracking:

        @app.get("/load", summary="Generation requests in flight (--enable-server-load-tracking)")
        async def load() -> JSONResponse:
            return JSONResponse({"server_load": server_load.in_flight})

    if settings.enable_tokenizer_info_endpoint:

        @app.get(
            "/tokenizer_info", summary="The tokenizer's configuration (--enable-tokenizer-info-endpoint)"
        )
        async def get_tokenizer_info() -> JSONResponse:
            return JSONResponse(tokenizer_info(ctx.tokenizer, settings.chat_template))

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
        if len(request.tokens) > ctx.max_model_len:
            raise APIError(
                f"tokens holds {len(request.tokens)} ids, above the limit of {ctx.max_model_len} (the "
                "server's --max-model-len: no prompt or output is longer): send at most "
                f"{ctx.max_model_len} ids per request",
                param="tokens",
            )
        vocab_size = engine.config.model.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                f"tokens holds {bad}, outside the vocabulary [0, {vocab_size}): send ids this model's "
                "tokenizer produced",
                param="tokens",
            )
        return DetokenizeResponse(prompt=await asyncio.to_thread(ctx.tokenizer.decode, request.tokens))

    @app.get(
        "/metrics",
        summary="Prometheus metrics (fitserve:* names)",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    if docs:
        app.openapi = lambda: _openapi_schema(app, settings)  # type: ignore[method-assign]
    return app


# Routes anyone may call with --api-key set (middleware.py): their schema declares no 401.
_PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs", "/redoc")


def _openapi_schema(app: FastAPI, settings: ServerSettings) -> dict:
    """FastAPI's schema made to agree with what the server sends: a bad body is a 400 in the error shape
    (never FastAPI's 422), each route lists the refusals it can send, and the generating routes declare
    their server-sent events beside the JSON body."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in components["ErrorResponse"].pop("$defs", {}).items():
        components[name] = definition
    error = {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = [
                HTTPStatus.NOT_FOUND,
                HTTPStatus.INTERNAL_SERVER_ERROR,
                HTTPStatus.SERVICE_UNAVAILABLE,
            ]
            if "requestBody" in operation or method == "post":  # a route reading its raw body has none
                statuses += [HTTPStatus.BAD_REQUEST, HTTPStatus.REQUEST_ENTITY_TOO_LARGE]
            if settings.api_key and path not in _PUBLIC_PATHS:
                statuses.append(HTTPStatus.UNAUTHORIZED)
            for status in statuses:
                responses.setdefault(str(int(status)), {"description": status.phrase, **error})
            if path in _STREAMING_PATHS and method == "post":
                content = responses.setdefault("200", {}).setdefault("content", {})
                content["text/event-stream"] = {"schema": {"type": "string"}}
    app.openapi_schema = schema
    return schema


# Routes that answer `stream: true` with server-sent events.
_STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions")
