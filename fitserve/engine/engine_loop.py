"""EngineLoop: the loop that drives a synchronous Engine beside the server, and the commands it takes.

Both backends of AsyncEngine run it: the engine thread (async_engine.py: its hooks call into the event
loop) and the engine process (engine_process.py: its hooks send replies down the pipe to the server).
Commands (add, abort, stop) arrive on a thread-safe queue; the loop drains it, applies them, steps while
the engine has work, and reports each round through its `on_*` hooks.

A step the engine could not run (e.g. out of GPU memory) ends its requests with final outputs whose
finish_reason is "error" and whose `error` says what to change (the engine logs it once); a request
whose own work in a step raised (e.g. seeding its generator) is ended alone the same way and the step
runs without it. These outputs pass through like any other and the engine goes on with the others.
A step that raises aborts the requests it was running (`on_failed`) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from dataclasses import dataclass
from typing import Any

from fitserve.core.outputs import RequestOutput
from fitserve.worker.rank_failure import RankFailedError

logger = logging.getLogger(__name__)


@dataclass
class AddCommand:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: Any  # SamplingParams
    accepted: asyncio.Future[None] | None = None  # None when sent to the engine process (not picklable)


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass(frozen=True)
class StopCommand:
    """Stop the engine loop (a class, not a bare object, so that it survives pickling)."""


STOP = StopCommand()


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

    def on_accepted(self, command: AddCommand, error: BaseException | None) -> None:
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
            stop = any(isinstance(command, StopCommand) for command in commands)
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
        if isinstance(command, AddCommand):
            try:
                self.engine.add_request(
                    command.request_id, command.prompt, command.prompt_token_ids, command.params
                )
            except Exception as error:
                self.on_accepted(command, error)
                return
            self.request_ids.add(command.request_id)
            self.on_accepted(command, None)
        elif isinstance(command, AbortCommand):
            live = [rid for rid in command.request_ids if rid in self.request_ids]
            if live:
                self.engine.abort_request(live)
                self.request_ids.difference_update(live)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RankFailedError as error:
            # A tensor-parallel rank is gone: end every request with the reason and stop the loop (the
            # server answers 503 from now on).
            logger.error("the engine stopped: %s", error)
            failed = list(self.request_ids)
            self.request_ids.clear()
            self.on_failed(failed, RuntimeError(f"the engine stopped: {error}; restart the server"))
            raise
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
