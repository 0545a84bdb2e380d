"""fitserve/bench/sse_http.py: the benchmark's plain HTTP/1.1 streaming POST, against asyncio servers on
127.0.0.1 that answer with exact bytes (chunked, sized, to the end of the connection, broken, not HTTP),
and send_request's failure kinds over it. tests/e2e/test_bench_serve.py runs it against fitserve."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from fitserve.bench import sse_http
from fitserve.bench.client import RequestInput, send_request

EVENTS = [
    {"choices": [{"index": 0, "text": "Hello"}]},
    {"choices": [{"index": 0, "text": " world"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]


def sse_body() -> bytes:
    return b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in EVENTS) + b"data: [DONE]\n\n"


def chunked(body: bytes, size: int) -> bytes:
    """`body` in chunks of `size` bytes (splitting lines and events across chunks), then the last chunk."""
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


async def serve_bytes(answer: bytes, seen: list[bytes]):
    """A server that reads one request (headers and Content-Length body), answers `answer`, closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        sized = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        length = int(sized[0].split(b":")[1])
        seen.append(head + await reader.readexactly(length))
        writer.write(answer)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def request_to(port: int, path: str = "/v1/completions") -> RequestInput:
    return RequestInput(
        backend="openai",
        api_url=f"http://127.0.0.1:{port}{path}",
        model="m",
        prompt="Hi",
        prompt_len=1,
        output_len=2,
        sampling={},
        headers={"Authorization": "Bearer k"},
        timeout_s=10.0,
    )


def run_against(answer: bytes):
    async def go():
        seen: list[bytes] = []
        server = await serve_bytes(answer, seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await send_request(None, request_to(port), raw_http=True)
        return result, seen

    return asyncio.run(go())


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("size", [1, 7, 64, 4096])
def test_a_chunked_stream_is_timed_event_by_event_whatever_the_chunking(size: int) -> None:
    result, seen = run_against(HEAD_CHUNKED + chunked(sse_body(), size))
    assert result.success, result.error
    assert result.generated_text == "Hello world"
    assert len(result.itl) == 1 and result.usage_completion_tokens == 2 and result.prompt_len == 3
    request = seen[0]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer k\r\n" in request and b"Connection: close\r\n" in request
    body = json.loads(request.split(b"\r\n\r\n", 1)[1])
    assert body["prompt"] == "Hi" and body["stream"] is True


def test_sized_and_connection_delimited_bodies() -> None:
    body = sse_body().replace(b"\n", b"\r\n")  # CRLF line ends too
    sized = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    assert run_against(sized)[0].generated_text == "Hello world"
    to_the_end = b"HTTP/1.1 200 OK\r\n\r\n" + sse_body()
    assert run_against(to_the_end)[0].success


def test_failures_keep_their_kinds() -> None:
    error = json.dumps({"error": {"message": "max_tokens is too large"}}).encode()
    refused = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(error) + error
    result = run_against(refused)[0]
    assert (result.success, result.failure_kind) == (False, "http_error")
    assert "HTTP 400: max_tokens is too large" in result.error
    # the connection closes inside a chunk: truncated, never a latency
    broken = HEAD_CHUNKED + chunked(sse_body(), 16)[:40]
    assert run_against(broken)[0].failure_kind == "truncated"
    # a stream that ends without [DONE]
    no_done = HEAD_CHUNKED + chunked(sse_body().replace(b"data: [DONE]\n\n", b""), 64)
    assert run_against(no_done)[0].failure_kind == "truncated"
    assert run_against(b"SSH-2.0-OpenSSH\r\n\r\n")[0].failure_kind == "stream_error"


def test_nothing_listening_is_a_connection_failure() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the request: nothing listens there
    result = asyncio.run(send_request(None, request_to(port), raw_http=True))
    assert (result.success, result.failure_kind) == (False, "connection")


def test_takes_plain_http_urls_only() -> None:
    assert sse_http.takes_url("http://127.0.0.1:8000/v1/completions")
    assert not sse_http.takes_url("https://example.com/v1/completions")
    assert not sse_http.takes_url("http:///v1/completions")
