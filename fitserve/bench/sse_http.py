"""A streamed POST over one plain HTTP/1.1 connection (asyncio streams): the timed requests of
`fitserve bench serve` against an http:// server.

Why not httpx for these: each server-sent event costs httpx's stack (httpcore, anyio, h11, the line
decoder) a few hundred microseconds of Python on a 2-core machine, so one client process saturates
at a few thousand events a second, and a server streaming 256 requests at 10 to 20 thousand tokens a
second is then measured by how fast the client reads: requests start late and their TTFT includes the
client's backlog. This reads the response with one `readline` and one `readexactly` per chunk. httpx
stays for everything else (the probe, https, proxies, the tests' in-process transports).

Each request opens its own connection (`Connection: close`); the response body may be chunked
(uvicorn's streaming responses), sized by Content-Length, or run to the end of the connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024


class HTTPResponseError(ValueError):
    """The server's bytes are not an HTTP/1.1 response this client reads."""


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()


def takes_url(url: str) -> bool:
    """True for the URLs this client serves (plain http with a host)."""
    parts = urlsplit(url)
    return parts.scheme == "http" and bool(parts.hostname)


async def post_json(url: str, payload: object, headers: dict[str, str]) -> RawResponse:
    """Sends `payload` as JSON to `url` and reads the status line and headers of the answer."""
    parts = urlsplit(url)
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    body = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, port, limit=MAX_HEADER_BYTES)
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.hostname}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as error:
        writer.close()
        raise HTTPResponseError(f"response headers longer than {MAX_HEADER_BYTES} bytes") from error
    except BaseException:
        writer.close()
        raise
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
        writer.close()
        raise HTTPResponseError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
    response_headers = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            response_headers[name.strip().lower()] = value.strip()
    return RawResponse(int(fields[1]), response_headers, reader, writer)


async def body_chunks(response: RawResponse) -> AsyncIterator[bytes]:
    """The response body as it arrives (chunked transfer decoded)."""
    reader = response.reader
    if "chunked" in response.headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise asyncio.IncompleteReadError(b"", None)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            chunk = await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
            yield chunk
    elif "content-length" in response.headers:
        left = int(response.headers["content-length"])
        while left > 0:
            chunk = await reader.read(min(left, 65536))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(chunk)
            yield chunk
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def body_lines(response: RawResponse) -> AsyncIterator[str]:
    """The body's lines (without line ends) as they complete; a last line without an end at the end."""
    pending = b""
    async for chunk in body_chunks(response):
        pending += chunk
        if b"\n" not in chunk:
            continue
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")


async def read_body(response: RawResponse) -> bytes:
    return b"".join([chunk async for chunk in body_chunks(response)])
