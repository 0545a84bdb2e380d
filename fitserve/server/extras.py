"""vLLM's optional server features, each behind its flag: the X-Request-Id header
(--enable-request-id-headers), the in-flight request count of GET /load (--enable-server-load-tracking),
GET /tokenizer_info (--enable-tokenizer-info-endpoint), and --root-path served with and without the
prefix. Also SageMaker's POST /invocations body routing (always on, as in vLLM)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "X-Request-Id"
# The routes whose requests /load counts: the ones that run the engine.
LOAD_TRACKED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/invocations"})


class RequestIdHeaderMiddleware:
    """Adds X-Request-Id to every HTTP response: the request's own X-Request-Id when it sent one, else a
    new random id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.lower().encode("latin-1"))
        request_id = incoming.decode("latin-1") if incoming else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """Generation requests in flight: counted from arrival until their response (a stream included)
    has been sent or the client left."""

    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


class RootPathMiddleware:
    """--root-path PREFIX: a proxy that strips the prefix and a client that calls PREFIX/v1/... directly
    both reach the routes. (uvicorn puts the root path in front of every request's path; a request that
    already carried the prefix then holds it twice, and one copy is dropped here.)"""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        prefix = self.root_path
        if scope["type"] in ("http", "websocket") and prefix:
            scope = dict(scope)
            scope["root_path"] = prefix
            path = scope["path"]
            rest = path[len(prefix) :] if _under(path, prefix) else path
            if _under(rest, prefix):  # the client sent the prefix itself
                rest = rest[len(prefix) :] or "/"
            scope["path"] = prefix + rest
            scope["raw_path"] = scope["path"].encode("utf-8")
        await self.app(scope, receive, send)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def _route_path(scope: Scope) -> str:
    path = scope.get("path", "")
    root = (scope.get("root_path") or "").rstrip("/")
    if root and _under(path, root):
        return path[len(root) :] or "/"
    return path


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's GET /tokenizer_info: the tokenizer's class, its configuration (init kwargs, JSON-safe), the
    added tokens by id, and the chat template the server renders with."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
        if key in ("added_tokens_decoder", "name_or_path") or key.startswith("_"):
            continue
        info[key] = _json_safe(value)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    info["added_tokens_decoder"] = {str(token_id): _json_safe(token) for token_id, token in decoder.items()}
    info["model_max_length"] = _json_safe(getattr(tokenizer, "model_max_length", None))
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "content") and hasattr(value, "special"):  # tokenizers' AddedToken
        fields = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
        return {name: getattr(value, name) for name in fields if hasattr(value, name)}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value
