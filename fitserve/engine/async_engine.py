"""AsyncEngine: the synchronous Engine driven from a background thread, for the asyncio server.

Two backends, one surface. `AsyncEngine(engine)` runs the Engine on a thread of this process (the
contract below). `AsyncEngine(EngineProcess.start(args))` runs it in a child process (engine_process.py,
what `fitserve serve` does on a GPU): the same `EngineLoop` runs there, commands go down a pipe, and a
receiver thread here hands each round's reply (acceptances, a step's outputs, stats) to the event loop
with one `call_soon_threadsafe`; the child's death fails in-flight requests as the thread's death does.

Threading contract: only the engine thread touches the Engine (it is not thread-safe). The event loop
hands it work through a thread-safe command queue (add, abort, stop); the engine thread hands outputs
back with `loop.call_soon_threadsafe`, one call per step, into each request's own asyncio.Queue. The
event loop never waits on the engine, so a long step never stalls other connections.

A consumer of `generate()` that goes away (client disconnect, task cancellation) aborts its request,
which frees its KV blocks at the engine's next command drain. `shutdown()` ends every in-flight request
with a final output whose finish_reason is "abort", then stops the thread.

A step the engine could not run (e.g. out of GPU memory) ends its requests with final outputs whose
finish_reason is "error" and whose `error` says what to change (the engine logs it once); a request
whose own work in a step raised (e.g. seeding its generator) is ended alone the same way and the step
runs without it. These outputs pass through like any other and the engine goes on with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fitserve.core.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

OutputObserver = Callable[[RequestOutput], None]


def stats_show_activity(previous: Any, current: Any) -> bool:
    """True when the interval processed tokens or requests are still running or waiting."""
    return bool(
        current.num_prompt_tokens_total != previous.num_prompt_tokens_total
        or current.num_generation_tokens_total != previous.num_generation_tokens_total
        or current.num_running
        or current.num_waiting
    )


def format_stats_line(previous: Any, current: Any, elapsed_s: float) -> str:
    """`Avg prompt throughput: X tokens/s, ... KV cache usage: P%, Prefix cache hit rate: Q%`.

    Throughputs are over the interval; the prefix cache hit rate is over all prompt tokens looked up
    since the start (hits / queries).
    """
    elapsed_s = max(elapsed_s, 1e-9)
    prompt_rate = (current.num_prompt_tokens_total - previous.num_prompt_tokens_total) / elapsed_s
    generation_rate = (current.num_generation_tokens_total - previous.num_generation_tokens_total) / elapsed_s
    queries = current.prefix_cache_queries
    hit_rate = 100.0 * current.prefix_cache_hits / queries if queries else 0.0
    return (
        f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
        f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
        f"Running: {current.num_running} reqs, Waiting: {current.num_waiting} reqs, "
        f"KV cache usage: {100.0 * current.kv_cache_usage:.1f}%, "
        f"Prefix cache hit rate: {hit_rate:.1f}%"
    )


def _stopped_message(error: BaseException) -> str:
    return (
        f"the engine stopped after an error ({type(error).__name__}; the server log has the details): "
        "restart the server"
    )


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or its thread has died; no new request can run."""


@dataclass
class _AddCommand:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: Any  # SamplingParams
    accepted: asyncio.Future[None] | None = None  # None when sent to the engine process (not picklable)


@dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclass(frozen=True)
class _StopCommand:
    """Stop the engine loop (a class, not a bare object, so that it survives pickling)."""


_STOP = _StopCommand()


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


class AsyncEngine:
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
            self._send(_AddCommand(request_id, prompt, prompt_token_ids, params))
        else:
            self._commands.put(_AddCommand(request_id, prompt, prompt_token_ids, params, accepted))
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

    def abort(self, request_id: str) -> None:
        """Stop a request now; its consumer (if any) is not told. Safe to call twice."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._notify(stream.aborted_output())
        self._send(_AbortCommand([request_id]))

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
            self._send(_AbortCommand(list(streams)))
        self._stop_sent = True
        self._send(_STOP)
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


class EngineLoop:
    """Drives an Engine: takes the commands queued for it, applies them, steps while it has work, and
    reports what happened through the `on_*` hooks. The engine thread runs one (its hooks call into the
    event loop); so does the engine process (engine_process.py: its hooks send replies to the server).
    `run()` returns after a stop command and raises what stops the engine for good."""

    def __init__(self, engine: Any, commands: queue.SimpleQueue[Any]) -> None:
        self.engine = engine
        self.commands = commands
        self.request_ids: set[str] = set()  # the requests the engine holds (accepted, not finished)

    # ---- hooks -----------------------------------------------------------------------------------

    def on_accepted(self, command: _AddCommand, error: BaseException | None) -> None:
        """The engine took the request (error None) or refused it (its ValueError)."""

    def on_commands_applied(self) -> None:
        """Every command taken this round is applied; the next step has not started."""

    def on_outputs(self, outputs: list[RequestOutput], stats: Any) -> None:
        """A step's outputs (possibly none), with the stats after it."""

    def on_failed(self, request_ids: list[str], error: BaseException) -> None:
        """A step raised: these requests were aborted in the engine and end with `error`."""

    def on_stats(self, stats: Any) -> None:
        """The stats after a round (commands, then a step if there was work)."""

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        engine = self.engine
        while True:
            idle = not engine.has_unfinished_requests()
            commands = self._take_commands(block=idle)
            stop = any(isinstance(command, _StopCommand) for command in commands)
            for command in commands:
                self._apply(command)
            self.on_commands_applied()
            if stop:
                self.on_stats(engine.get_stats())
                return
            if engine.has_unfinished_requests():
                self._step()
            self.on_stats(engine.get_stats())

    def _take_commands(self, block: bool) -> list[Any]:
        commands: list[Any] = []
        if block:
            commands.append(self.commands.get())
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self.commands.get_nowait())
        return commands

    def _apply(self, command: Any) -> None:
        if isinstance(command, _AddCommand):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.prompt_token_ids, command.params
                )
            except Exception as error:
                self.on_accepted(command, error)
                return
            self.request_ids.add(command.request_id)
            self.on_accepted(command, None)
        elif isinstance(command, _AbortCommand):
            live = [rid for rid in command.request_ids if rid in self.request_ids]
            if live:
                self.engine.abort_request(live)
                self.request_ids.difference_update(live)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # One bad step must not take the server down: end the requests it was running and go on.
            logger.exception("engine step failed; aborting its %d request(s)", len(self.request_ids))
            failed = list(self.request_ids)
            with contextlib.suppress(Exception):
                self.engine.abort_request(failed)
            self.request_ids.clear()
            failure = RuntimeError(
                f"the engine failed while generating ({type(error).__name__}; the server log has the details)"
            )
            self.on_failed(failed, failure)
            return
        for output in outputs:
            if output.finished:
                self.request_ids.discard(output.request_id)
        # Published before the outputs: a client that has its last token reads stats that count it done.
        self.on_outputs(outputs, self.engine.get_stats())


class _ThreadEngineLoop(EngineLoop):
    """The engine thread's loop: results go to the event loop with `call_soon_threadsafe`."""

    def __init__(self, owner: AsyncEngine) -> None:
        super().__init__(owner.engine, owner._commands)
        self.owner = owner

    def on_accepted(self, command: _AddCommand, error: BaseException | None) -> None:
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
