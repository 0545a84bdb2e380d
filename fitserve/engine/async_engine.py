"""AsyncEngine: the synchronous Engine driven from a background thread, for the asyncio server.

Two backends, one surface. `AsyncEngine(engine)` runs the Engine on a thread of this process (the
contract below). `AsyncEngine(EngineProcess.start(args))` runs it in a child process (engine_process.py,
what `fitserve serve` does on a GPU): the same `EngineLoop` (engine_loop.py) runs there, commands go down
a pipe, and a receiver thread here hands each round's reply (acceptances, a step's outputs, stats) to the
event loop with one `call_soon_threadsafe`; the child's death fails in-flight requests as the thread's
death does.

Threading contract: only the engine thread touches the Engine (it is not thread-safe). The event loop
hands it work through a thread-safe command queue (add, abort, stop); the engine thread hands outputs
back with `loop.call_soon_threadsafe`, one call per step, into each request's own asyncio.Queue (its
RequestStream, request_stream.py). The event loop never waits on the engine, so a long step never stalls
other connections.

A consumer of `generate()` that goes away (client disconnect, task cancellation) aborts its request,
which frees its KV blocks at the engine's next command drain. `shutdown()` ends every in-flight request
with a final output whose finish_reason is "abort", then stops the thread. How a failed step ends its
requests: engine_loop.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fitserve.core.outputs import RequestOutput
from fitserve.engine.engine_loop import STOP, AbortCommand, AddCommand, EngineLoop
from fitserve.engine.request_stream import RequestStream
from fitserve.engine.stats_line import format_spec_decode_line, format_stats_line, stats_show_activity

logger = logging.getLogger(__name__)

OutputObserver = Callable[[RequestOutput], None]


def _stopped_message(error: BaseException) -> str:
    return (
        f"the engine stopped after an error ({type(error).__name__}; the server log has the details): "
        "restart the server"
    )


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or its thread has died; no new request can run."""


class StreamsRequests:
    """`generate` over an `add_request` that returns a RequestStream (AsyncEngine, DataParallelEngine)."""

    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: Any
    ) -> RequestStream:
        raise NotImplementedError

    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: Any,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until the final one; leaving early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, prompt_token_ids, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()


class AsyncEngine(StreamsRequests):
    def __init__(
        self,
        engine: Any,
        *,
        log_stats: bool = True,
        stats_interval_s: float = 10.0,
        observers: list[OutputObserver] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self._default_params = engine.default_sampling_params()
        self.log_stats = log_stats
        self.stats_interval_s = stats_interval_s
        self.observers: list[OutputObserver] = list(observers or [])
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stats = engine.get_stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self._accepting = False
        self._dead: BaseException | None = None
        # The process backend (engine_process.EngineProcess): the Engine runs in a child process; commands go
        # through a pipe and a receiver thread hands its replies to the event loop.
        self._process: Any = engine if getattr(engine, "runs_in_process", False) else None
        self._pending_adds: dict[str, asyncio.Future[None]] = {}  # process backend: sent, not yet answered
        self._receiver: threading.Thread | None = None
        self._stop_sent = False

    # ---- event-loop side -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        if self._process is not None:
            self._receiver = threading.Thread(
                target=self._receive_replies, name="fitserve-engine-replies", daemon=True
            )
            self._receiver.start()
        else:
            self._thread = threading.Thread(
                target=self._run_engine_thread, name="fitserve-engine", daemon=True
            )
            self._thread.start()
        if self.log_stats:
            self._stats_task = asyncio.create_task(self._log_stats_forever())

    @property
    def is_healthy(self) -> bool:
        if self._process is not None:
            receiving = self._receiver is not None and self._receiver.is_alive()
            return self._dead is None and receiving and self._process.is_alive()
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def default_sampling_params(self) -> Any:
        return self._default_params

    def get_stats(self) -> Any:
        """The engine's stats after its latest step or command drain (read without locking: one reference)."""
        return self._stats

    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: Any,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it. The engine's ValueError is re-raised."""
        if not self._accepting or self._loop is None:
            raise EngineUnavailableError("the server is shutting down: no new requests are accepted")
        if self._dead is not None:
            raise EngineUnavailableError(_stopped_message(self._dead))
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running: use a unique id")
        stream = RequestStream(request_id, getattr(params, "n", 1), on_close=self.abort)
        self._streams[request_id] = stream
        accepted: asyncio.Future[None] = self._loop.create_future()
        if self._process is not None:
            self._pending_adds[request_id] = accepted
            self._send(AddCommand(request_id, prompt, prompt_token_ids, params))
        else:
            self._commands.put(AddCommand(request_id, prompt, prompt_token_ids, params, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._pending_adds.pop(request_id, None)
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request now; its consumer (if any) is not told. Safe to call twice."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._notify(stream.aborted_output())
        self._send(AbortCommand([request_id]))

    def begin_shutdown(self) -> None:
        """Refuse new requests, end every in-flight one with a final aborted output, stop the thread."""
        self._accepting = False
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            final = stream.aborted_output()
            self._notify(final)
            stream.put(final)
        if streams:
            logger.info("Shutting down: aborted %d in-flight request(s)", len(streams))
            self._send(AbortCommand(list(streams)))
        self._stop_sent = True
        self._send(STOP)
        if self._stats_task is not None:
            self._stats_task.cancel()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._process is not None:
            if self._accepting or not self._stop_sent:
                self.begin_shutdown()
            # the engine process finishes its step, takes the stop and exits (killed if it does not in time)
            await asyncio.get_running_loop().run_in_executor(None, self._process.stop, timeout_s)
            if self._receiver is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._receiver.join, timeout_s)
            return
        if self._accepting or self._thread is None or self._thread.is_alive():
            self.begin_shutdown()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    def _send(self, command: Any) -> None:
        """A command for the engine: onto the engine thread's queue, or down the engine process's pipe."""
        if self._process is None:
            self._commands.put(command)
            return
        try:
            self._process.send(command)
        except (OSError, ValueError):  # the process is gone (its death is reported by the receiver)
            logger.debug("engine process gone: dropped %s", type(command).__name__)

    def _notify(self, output: RequestOutput) -> None:
        for observer in self.observers:
            try:
                observer(output)
            except Exception:
                logger.exception("output observer %r failed on request %s", observer, output.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted meanwhile
            self._notify(output)
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _resolve(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._notify(stream.aborted_output())
                stream.put(error)

    def _on_thread_death(self, error: BaseException) -> None:
        self._dead = error
        self._fail(list(self._streams), EngineUnavailableError(_stopped_message(error)))
        pending, self._pending_adds = self._pending_adds, {}
        for accepted in pending.values():
            self._resolve(accepted, EngineUnavailableError(_stopped_message(error)))

    # ---- process backend: the receiver thread and what it hands the event loop -----------------------

    def _receive_replies(self) -> None:
        """The receiver thread: it only waits on the pipe (without the GIL), unpickles one reply per
        engine round and queues its handling on the event loop."""
        assert self._process is not None
        try:
            while True:
                reply = self._process.receive()
                if reply.died is not None:  # the engine loop raised: the process logged it and exits
                    error: BaseException = reply.died
                    break
                self._call_in_loop(self._on_reply, reply)
        except (EOFError, OSError):
            if self._stop_sent:
                return  # it exited after our stop, as it should
            error = self._process.death_error()
            logger.error("%s", error)
        self._call_in_loop(self._on_thread_death, error)

    def _on_reply(self, reply: Any) -> None:
        if reply.stats is not None:
            self._stats = reply.stats
        for request_id, error in reply.accepted:
            accepted = self._pending_adds.pop(request_id, None)
            if accepted is not None:
                self._resolve(accepted, error)
        if reply.failed is not None:
            self._fail(*reply.failed)
        if reply.outputs:
            self._deliver(reply.outputs)

    async def _log_stats_forever(self) -> None:
        previous, previous_time = self._stats, time.monotonic()
        last_was_active = False
        while True:
            await asyncio.sleep(self.stats_interval_s)
            current, now = self._stats, time.monotonic()
            active = stats_show_activity(previous, current)
            if active or last_was_active:
                logger.info(format_stats_line(previous, current, now - previous_time))
                spec_line = format_spec_decode_line(previous, current)
                if spec_line is not None:
                    logger.info(spec_line)
            last_was_active = active
            previous, previous_time = current, now

    # ---- engine thread ---------------------------------------------------------------------------

    def _run_engine_thread(self) -> None:
        try:
            _ThreadEngineLoop(self).run()
        except BaseException as error:
            logger.exception("the engine thread stopped")
            self._call_in_loop(self._on_thread_death, error)

    def _call_in_loop(self, callback: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown: nobody is listening
            self._loop.call_soon_threadsafe(callback, *args)


class _ThreadEngineLoop(EngineLoop):
    """The engine thread's loop: results go to the event loop with `call_soon_threadsafe`."""

    def __init__(self, owner: AsyncEngine) -> None:
        super().__init__(owner.engine, owner._commands)
        self.owner = owner

    def on_accepted(self, command: AddCommand, error: BaseException | None) -> None:
        assert command.accepted is not None
        self.owner._call_in_loop(self.owner._resolve, command.accepted, error)

    def on_outputs(self, outputs: list[RequestOutput], stats: Any) -> None:
        self.owner._stats = stats
        if outputs:
            self.owner._call_in_loop(self.owner._deliver, outputs)

    def on_failed(self, request_ids: list[str], error: BaseException) -> None:
        self.owner._call_in_loop(self.owner._fail, request_ids, error)

    def on_stats(self, stats: Any) -> None:
        self.owner._stats = stats
