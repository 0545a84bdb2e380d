"""ASGI middleware: API-key check and request-body cap, both answering in OpenAI's error shape."""

from __future__ import annotations

import hmac
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fitserve.server.errors import APIError

# Routes reachable without the API key: probes and monitoring.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        path = path[len(root_path) :] or "/"
    return path.rstrip("/") or "/"


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (compared in constant time) outside OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or _route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        reason = "no Authorization header was sent" if not given else "the API key does not match"
        error = APIError(
            f"unauthorized: {reason}; send the header `Authorization: Bearer <key>` with the key the "
            "server was started with (--api-key or FITSERVE_API_KEY)",
            HTTPStatus.UNAUTHORIZED,
        )
        await error.to_response()(scope, receive, send)


class RequestBodyTooLarge(HTTPException):
    def __init__(self, size: int, limit: int, exact: bool) -> None:
        size_text = f"{size} bytes" if exact else f"more than {limit} bytes"
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body has {size_text}, above the limit of {limit} bytes: send a smaller request "
            "or start the server with a larger --max-request-body-bytes",
        )


class BodySizeLimitMiddleware:
    """Refuses bodies above `limit` bytes: by Content-Length up front, else while the body is read."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                error = RequestBodyTooLarge(int(value), self.limit, exact=True)
                await APIError(error.detail, error.status_code).to_response()(scope, receive, send)
                return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise RequestBodyTooLarge(received, self.limit, exact=False)
            return message

        await self.app(scope, counting_receive, send)
