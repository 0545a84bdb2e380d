"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every refusal the server sends goes through `APIError`, so a client that reads `error.message`
(the openai SDK, LangChain, gateways) always finds one sentence naming the value, the limit and
the fix. `type` follows vLLM's names (BadRequestError, ...); `code` is the HTTP status.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from fitserve.core.outputs import RequestOutput
from fitserve.engine.out_of_memory import is_out_of_memory_message

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: "UnsupportedMediaTypeError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}


class ErrorJSONResponse(JSONResponse):
    """JSON escaped to ASCII: a message that quotes a request's text stays sendable even when that text
    holds a lone UTF-16 surrogate (which UTF-8 cannot encode)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """Raised anywhere in the server to refuse a request; rendered by `api_error_handler`."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        allow: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = HTTPStatus(status)
        self.param = param
        self.allow = allow  # a 405's Allow header: the methods the route takes

    def to_dict(self) -> dict[str, Any]:
        error_type = _ERROR_TYPES.get(self.status, self.status.phrase.replace(" ", "") + "Error")
        return {
            "error": {
                "message": self.message,
                "type": error_type,
                "param": self.param,
                "code": int(self.status),
            }
        }

    def to_response(self) -> JSONResponse:
        headers = {"Allow": self.allow} if self.allow else None
        return ErrorJSONResponse(self.to_dict(), status_code=int(self.status), headers=headers)

    def to_sse(self) -> str:
        return f"data: {json.dumps(self.to_dict())}\n\n"


def raise_if_generation_failed(outputs: Iterable[RequestOutput]) -> None:
    """An output the engine ended with an error becomes an error carrying the engine's message: a 503
    when its step ran out of GPU memory (the server is up and the request can be retried), else a 500."""
    for output in outputs:
        if output.error is not None:
            oom = is_out_of_memory_message(output.error)
            raise APIError(
                output.error, HTTPStatus.SERVICE_UNAVAILABLE if oom else HTTPStatus.INTERNAL_SERVER_ERROR
            )


def describe_validation_error(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One sentence for pydantic's first error: `field.path: what is wrong (got VALUE)`, and the field.

    A value that fits no member of a union gets one error per member: their messages are joined.
    """
    first = errors[0]
    if first.get("type") == "json_invalid":
        position = first.get("ctx", {}).get("error", "")
        detail = f" ({position})" if position else ""
        return f"the request body is not valid JSON{detail}: send a JSON object", None
    loc = [part for part in first.get("loc", ()) if part != "body"]
    field = _field_path(loc)
    if first.get("type") == "missing":
        return f"{field} is required: add it to the request body", field or None
    if first.get("type") == "model_attributes_type" and not loc:
        return "the request body must be a JSON object: send {...} with the request's fields", None
    same_field = [e for e in errors if _field_path([p for p in e.get("loc", ()) if p != "body"]) == field]
    messages = list(
        dict.fromkeys(str(e.get("msg", "is invalid")).removeprefix("Value error, ") for e in same_field)
    )
    message = "; or ".join(messages)
    got = first.get("input")
    shown = json.dumps(got)[:80] if _is_json(got) else repr(got)[:80]
    named = [part for part in loc if isinstance(part, str) and _is_field_name(part)]
    last_name = named[-1] if named else ""
    where = f"{field}: " if field and not message.startswith(f"{last_name} ") else ""
    return f"{where}{message} (got {shown})", field or None


def _is_field_name(part: str) -> bool:
    # pydantic names union members by type: "str", "list[int]", "NamedToolChoice", "function-after[...]"
    return part not in _TYPE_TAGS and "[" not in part and not part[:1].isupper()


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple", "json-or-python"})


def _field_path(loc: list[Any]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and _is_field_name(part):
            path += f".{part}" if path else part
    return path


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if errors and errors[0].get("type") == "missing" and tuple(errors[0].get("loc", ())) == ("body",):
        required = _required_body_fields(request)
        fields = " and ".join(required) if required else "the route's fields"
        message = f"the request body is empty: send a JSON object with {fields}"
        return APIError(message, HTTPStatus.BAD_REQUEST, required[0] if required else None).to_response()
    message, param = describe_validation_error(errors)
    return APIError(message, HTTPStatus.BAD_REQUEST, param).to_response()


def _required_body_fields(request: Request) -> list[str]:
    """The required fields of the body model of the route that was called (empty when unknown)."""
    body_field = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body_field, "field_info", None), "annotation", None)
    fields = getattr(model, "model_fields", None) or {}
    return [name for name, field in fields.items() if field.is_required()]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every refusal, as /openapi.json declares it."""

    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route's refusals: each status with the error body."""
    return {
        int(status): {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses
    }
