"""One streamed request to an OpenAI-compatible server, timed chunk by chunk on the client's clock.

A request succeeds only when the server answered 200, at least one token chunk arrived, and the stream
ended with `data: [DONE]`. Anything else is a failure with a kind (FAILURE_KINDS) and a one-line reason;
a failed request's partial timings are never used as latencies.

A token chunk is any chunk with a choice, as vLLM's benchmark counts them: its text may be empty, since
a token can add no text yet (part of a UTF-8 character, a special token, an id the tokenizer has no
text for). Two kinds of chunk carry no token: a usage chunk (no choices), and a chat chunk that only
names the role, so a server that sends its role before the first token does not shorten TTFT.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from fitserve.bench import sse_http

BACKEND_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
FAILURE_KINDS = ("http_error", "timeout", "truncated", "connection", "stream_error", "no_token")
# Characters of an error body kept in a failure's reason.
ERROR_BODY_CHARS = 300


@dataclass(frozen=True)
class RequestInput:
    backend: str
    api_url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    sampling: dict[str, Any]  # extra body fields: temperature, top_p, top_k, ignore_eos
    headers: dict[str, str]
    timeout_s: float


@dataclass
class RequestResult:
    prompt_len: int  # the server's usage.prompt_tokens when it sent one, else the dataset's count
    start_time: float = 0.0
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    generated_text: str = ""
    usage_completion_tokens: int | None = None
    failure_kind: str = ""
    error: str = ""

    def fail(self, kind: str, reason: str) -> None:
        self.success = False
        self.failure_kind = kind
        self.error = reason


def build_payload(request: RequestInput) -> dict[str, Any]:
    if request.backend == "openai":
        body: dict[str, Any] = {
            "model": request.model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
        }
    elif request.backend == "openai-chat":
        body = {
            "model": request.model,
            "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.output_len,
        }
    else:
        raise ValueError(f"backend={request.backend!r} is not one of {', '.join(BACKEND_ENDPOINTS)}")
    body.update(request.sampling)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def token_chunk_text(data: dict[str, Any]) -> str | None:
    """The generated text of a token chunk's first choice ("" when its tokens add none), or None when
    the chunk carries no token: it has no choices, or it is a chat chunk naming only the role."""
    choices = data.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    parts = (delta.get("reasoning_content"), delta.get("reasoning"), delta.get("content"))
    text = "".join(part for part in parts if isinstance(part, str))
    if delta.get("role") is not None and not text and not delta.get("tool_calls"):
        return None
    return text


class StreamTimer:
    """Turns server-sent `data:` payloads, each with the clock reading at its arrival, into timings."""

    def __init__(self, result: RequestResult, start_time: float) -> None:
        self.result = result
        self.start_time = start_time
        self.last_token_time: float | None = None
        self.done = False
        self.num_token_chunks = 0
        self.texts: list[str] = []  # joined into result.generated_text at the end (no quadratic +=)

    def add(self, payload: str, now: float) -> None:
        """A payload as text ([DONE] or JSON)."""
        self.add_decoded(payload if payload == "[DONE]" else json.loads(payload), now)

    def add_decoded(self, data: Any, now: float) -> None:
        """A payload already decoded (SSELines hands them out so: each chunk's JSON is parsed once)."""
        if data == "[DONE]":
            self.done = True
            return
        if not isinstance(data, dict):
            raise ValueError(f"a stream chunk is not a JSON object: {str(data)[:80]}")
        if data.get("error") is not None:
            raise StreamError(_error_message(data))
        usage = data.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.result.usage_completion_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.result.prompt_len = usage["prompt_tokens"]
        text = token_chunk_text(data)
        if text is None:
            return
        if self.last_token_time is None:
            self.result.ttft = now - self.start_time
        else:
            self.result.itl.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_token_chunks += 1
        self.texts.append(text)

    def finish(self) -> None:
        """Decide success once the stream has closed."""
        self.result.generated_text = "".join(self.texts)
        if not self.done:
            self.result.fail(
                "truncated",
                f"the stream ended without data: [DONE] after {self.num_token_chunks} token chunks",
            )
        elif self.last_token_time is None:
            self.result.fail("no_token", "the stream ended without any token chunk")
        else:
            self.result.latency = self.last_token_time - self.start_time
            self.result.success = True


class StreamError(Exception):
    """The server reported an error inside the stream."""


class SSELines:
    """Assembles `data:` payloads from server-sent-event lines; comments and other fields are skipped.

    A payload is handed out as soon as its data line parses as JSON (or is [DONE]), so its timestamp is
    taken when it arrives, and it is handed out decoded (its JSON parsed once, here); data split over
    several lines is joined and handed out at the blank line. `feed` returns None or the decoded payload
    ("[DONE]" for the end; a payload that is not JSON comes out as its text, which StreamTimer refuses).
    """

    def __init__(self) -> None:
        self.pending: list[str] = []

    def feed(self, line: str) -> Any:
        if not line:
            return self._flush()
        if line.startswith(":") or not line.startswith("data:"):
            return None
        value = line[5:].removeprefix(" ")
        self.pending.append(value)
        joined = "\n".join(self.pending) if len(self.pending) > 1 else value
        if joined == "[DONE]":
            self.pending.clear()
            return joined
        try:
            decoded = json.loads(joined)
        except json.JSONDecodeError:
            return None
        self.pending.clear()
        return decoded

    def _flush(self) -> Any:
        if not self.pending:
            return None
        joined = "\n".join(self.pending)
        self.pending.clear()
        try:
            return json.loads(joined)
        except json.JSONDecodeError:
            return joined


async def send_request(
    client: httpx.AsyncClient, request: RequestInput, raw_http: bool = False
) -> RequestResult:
    """Send one request and time its stream; never raises for a failed request. raw_http: over one
    plain HTTP/1.1 connection of its own (sse_http.py) instead of `client` (http:// URLs only)."""
    result = RequestResult(prompt_len=request.prompt_len)
    stream = _stream_raw(request, result) if raw_http else _stream(client, request, result)
    try:
        await asyncio.wait_for(stream, timeout=request.timeout_s)
    except asyncio.TimeoutError:
        result.fail("timeout", f"no complete answer within {request.timeout_s:g} s (--request-timeout)")
    except httpx.TimeoutException as error:
        result.fail("timeout", f"{type(error).__name__}: {error}")
    except (httpx.ConnectError, ConnectionRefusedError, socket.gaierror) as error:
        result.fail("connection", f"cannot connect to {request.api_url}: {error}")
    except (httpx.TransportError, asyncio.IncompleteReadError, ConnectionError) as error:
        result.fail("truncated", f"the connection broke mid-answer ({type(error).__name__}: {error})")
    except OSError as error:  # the raw connection: unreachable network and the like
        result.fail("connection", f"cannot connect to {request.api_url}: {error}")
    except StreamError as error:
        result.fail("stream_error", f"the server reported an error mid-stream: {error}")
    except ValueError as error:  # json.JSONDecodeError and sse_http.HTTPResponseError included
        result.fail("stream_error", f"unreadable stream chunk: {error}")
    return result


async def _stream(client: httpx.AsyncClient, request: RequestInput, result: RequestResult) -> None:
    payload = build_payload(request)
    result.start_time = time.perf_counter()
    timer = StreamTimer(result, result.start_time)
    async with client.stream("POST", request.api_url, json=payload, headers=request.headers) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", errors="replace")
            result.fail("http_error", f"HTTP {response.status_code}: {_body_message(body)}")
            return
        await _time_events(response.aiter_lines(), timer)
    timer.finish()


async def _stream_raw(request: RequestInput, result: RequestResult) -> None:
    payload = build_payload(request)
    result.start_time = time.perf_counter()
    timer = StreamTimer(result, result.start_time)
    response = await sse_http.post_json(request.api_url, payload, request.headers)
    try:
        if response.status != 200:
            body = (await sse_http.read_body(response)).decode("utf-8", errors="replace")
            result.fail("http_error", f"HTTP {response.status}: {_body_message(body)}")
            return
        await _time_events(sse_http.body_lines(response), timer)
    finally:
        response.close()
    timer.finish()


async def _time_events(lines: AsyncIterator[str], timer: StreamTimer) -> None:
    """Each SSE payload of `lines` into `timer`, with the clock reading at its arrival."""
    events = SSELines()
    async for line in lines:
        payload = events.feed(line)
        if payload is not None:
            timer.add_decoded(payload, time.perf_counter())
    trailing = events.feed("")
    if trailing is not None:
        timer.add_decoded(trailing, time.perf_counter())


def _error_message(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error)[:ERROR_BODY_CHARS]


def _body_message(body: str) -> str:
    """An error body's message field, or its first characters on one line."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        for candidate in (data.get("error"), data):
            if isinstance(candidate, dict) and candidate.get("message"):
                return str(candidate["message"])[:ERROR_BODY_CHARS]
    return " ".join(body.split())[:ERROR_BODY_CHARS] or "(empty body)"
