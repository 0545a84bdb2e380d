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

from fitserve.core.outputs import RequestOutput

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


class APIError(Exception):
    """Raised anywhere in the server to refuse a request; rendered by `api_error_handler`."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = HTTPStatus(status)
        self.param = param

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
        return JSONResponse(self.to_dict(), status_code=int(self.status))

    def to_sse(self) -> str:
        return f"data: {json.dumps(self.to_dict())}\n\n"


def raise_if_generation_failed(outputs: Iterable[RequestOutput]) -> None:
    """An output the engine ended with an error (e.g. its step ran out of GPU memory) becomes a 503
    carrying the engine's message: the server is up and the request can be retried."""
    for output in outputs:
        if output.error is not None:
            raise APIError(output.error, HTTPStatus.SERVICE_UNAVAILABLE)


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


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation_error(list(exc.errors()))
    return APIError(message, HTTPStatus.BAD_REQUEST, param).to_response()
