"""RequestStream: one request's outputs on the server's event loop, as AsyncEngine hands them over.

AsyncEngine puts each output (or the error that ends the request) into the request's own asyncio.Queue;
the consumer iterates the stream. A consumer that goes away closes it, which aborts the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from fitserve.core.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """One request's outputs. Iterating yields the newest cumulative output available (older ones
    queued behind it are skipped: each output contains everything before it) until the final one."""

    def __init__(
        self, request_id: str, num_choices: int, on_close: Callable[[str], None] | None = None
    ) -> None:
        self.request_id = request_id
        self.num_choices = num_choices
        self._on_close = on_close
        self.latest: RequestOutput | None = None
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.latest = item
        self._queue.put_nowait(item)

    def close(self) -> None:
        """The consumer is done: abort the request unless it already finished."""
        if not self.finished and self._on_close is not None:
            self.finished = True
            self._on_close(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def final_output(self) -> RequestOutput:
        """Wait for the final output; leaving early (cancellation) aborts the request."""
        final: RequestOutput | None = None
        try:
            async for output in self:
                final = output
        finally:
            self.close()
        if final is None:  # the stream ended without an output: only an abort does that
            return self.aborted_output()
        return final

    def aborted_output(self) -> RequestOutput:
        """The last output with every unfinished choice marked finish_reason="abort"."""
        if self.latest is None:
            choices = [CompletionOutput(i, "", [], None, None, "abort") for i in range(self.num_choices)]
            return RequestOutput(self.request_id, None, [], choices, finished=True)
        choices = [
            c if c.finish_reason is not None else dataclasses.replace(c, finish_reason="abort")
            for c in self.latest.outputs
        ]
        return dataclasses.replace(self.latest, outputs=choices, finished=True)
