"""Server-sent events and client-disconnect handling.

`EventStreamResponse` sends `data: ...` events from an async iterator and, unlike a plain streaming
response, watches for the client going away while the iterator waits: the iterator is then closed at
once (its `finally` aborts the engine request), not at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload_json: str) -> str:
    return f"data: {payload_json}\n\n"


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[], None] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close  # runs when the response ends, even if `events` never started
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.create_task(self._send_events(send))
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait((sender, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await _close_quietly(self.events)
            if self.on_close is not None:
                self.on_close()
        if sender.done() and not sender.cancelled() and sender.exception() is not None:
            exception = sender.exception()
            if not isinstance(exception, OSError):  # a broken pipe is a disconnect, not an error
                raise exception

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (aborting its engine requests)."""
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnected()
    return task.result()


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Items of several iterators as they come, tagged with the iterator's position.

    Closing the merged iterator (or an error in one of them) cancels and closes all of them. A single
    iterator is read directly, without the task and queue that merging needs (one hop less a token).
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _close_quietly(iterators[0])
        return
    queue: asyncio.Queue[tuple[int, Any] | None] = asyncio.Queue()
    _ERROR = object()

    async def pump(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((-1, (_ERROR, exc)))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, item = entry
            if index < 0:
                raise item[1]
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for iterator in iterators:
            await _close_quietly(iterator)


async def _close_quietly(iterator: Any) -> None:
    """Close an async iterator that has `aclose`; an error while closing is not the caller's concern."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
