"""The engine process's own side (started by EngineProcess, engine_process.py, with "spawn").

`run_engine_process` resolves the config from the EngineArgs (the planner's lines log from here, so the
server process never touches the GPU), builds the Engine, then runs the same `EngineLoop` as the engine
thread (engine_loop.py). A receiver thread moves commands (add, abort, stop) from the pipe into the
loop's queue, so the server's sends never wait for a step. Each round sends at most two replies, each one
pickled message (engine_process_pipe.py): the acceptances (or the engine's ValueError) of the requests
just added, then the step's outputs, as deltas (output_deltas.py), with the stats after it.

Signals: the child ignores SIGINT (a Ctrl-C reaches the whole process group; the server sends the stop).
It exits by itself when the server process goes away (its pipe closes, or its parent changes), so no
engine process outlives its server.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import resource
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from fitserve.core.outputs import RequestOutput
from fitserve.engine.engine_gc import settle_engine_heap
from fitserve.engine.engine_loop import STOP, AbortCommand, AddCommand, EngineLoop
from fitserve.engine.engine_process_pipe import EngineReady, Reply, portable_error, widen_pipe
from fitserve.engine.output_deltas import OutputEncoder

logger = logging.getLogger(__name__)

_PARENT_WATCH_S = 1.0


class _ProcessEngineLoop(EngineLoop):
    """The engine loop's results, as replies down the pipe: acceptances as soon as the commands are
    applied, then each step's outputs in one message; the stats ride along (alone only when changed)."""

    def __init__(self, engine: Any, commands: queue.SimpleQueue[Any], replies: Connection) -> None:
        super().__init__(engine, commands)
        self.replies = replies
        self._accepted: list[tuple[str, BaseException | None]] = []
        self._sent_stats: Any = None
        self._encoder = OutputEncoder()
        self._forgotten: list[str] = []

    def _send(self, reply: Reply) -> None:
        if reply.stats is not None:
            self._sent_stats = reply.stats
        if self._forgotten:
            reply.forgotten, self._forgotten = self._forgotten, []
        self.replies.send(reply)

    def _apply(self, command: Any) -> None:
        super()._apply(command)
        if isinstance(command, AbortCommand):
            self._forgotten.extend(rid for rid in command.request_ids if self._encoder.forget(rid))

    def on_accepted(self, command: AddCommand, error: BaseException | None) -> None:
        self._accepted.append((command.request_id, None if error is None else portable_error(error)))

    def on_commands_applied(self) -> None:
        if self._accepted:
            accepted, self._accepted = self._accepted, []
            self._send(Reply(accepted=accepted, stats=self.engine.get_stats()))

    def on_outputs(self, outputs: list[RequestOutput], stats: Any) -> None:
        if outputs:
            self._send(Reply(outputs=self._encoder.encode(outputs), stats=stats))

    def on_failed(self, request_ids: list[str], error: BaseException) -> None:
        self._forgotten.extend(rid for rid in request_ids if self._encoder.forget(rid))
        self._send(Reply(failed=(request_ids, portable_error(error)), stats=self.engine.get_stats()))

    def on_stats(self, stats: Any) -> None:
        if stats != self._sent_stats:
            self._send(Reply(stats=stats))


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends the child when the server process is gone (killed with SIGKILL, say) while it loads."""
    while True:
        time.sleep(_PARENT_WATCH_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _receive_commands(commands_in: Connection, commands: queue.SimpleQueue[Any]) -> None:
    try:
        while True:
            commands.put(commands_in.recv())
    except (EOFError, OSError):  # the server is gone: stop
        commands.put(STOP)


def run_engine_process(
    engine_args: Any,
    serving: bool,
    decode_logprob_tokens: bool,
    commands_in: Connection,
    replies: Connection,
    parent_pid: int,
    visible_devices: str | None = None,
) -> None:
    """The engine process's main function."""
    if visible_devices is not None:  # before anything asks CUDA for its devices
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The server started this process as a daemon (it goes when the server goes); a daemon may not start
    # processes, and tensor parallel starts one per rank. Only this process's own view changes: the
    # server still ends it at exit, and its ranks (daemons themselves) end with it.
    multiprocessing.current_process().daemon = False
    watch = threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid,), name="fitserve-parent", daemon=True
    )
    watch.start()
    widen_pipe(replies)
    from fitserve.engine.engine import Engine
    from fitserve.logger import configure_default_logging
    from fitserve.planner.resolve import create_engine_config

    configure_default_logging()
    try:
        config = create_engine_config(engine_args, serving=serving)
        replies.send(("config", config))
        engine = Engine(config)
        engine.output_processor.decode_logprob_tokens = decode_logprob_tokens
        engine.output_processor.share_token_lists = True  # each step's outputs are encoded at once
        settle_engine_heap()
        ready = EngineReady(
            memory_plan=engine.memory_plan,
            generation_defaults=engine.generation_defaults,
            eos_token_ids=engine.eos_token_ids,
            default_sampling_params=engine.default_sampling_params(),
            stats=engine.get_stats(),
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )
    except BaseException as error:
        with contextlib.suppress(OSError):
            replies.send(("error", portable_error(error, with_traceback=not isinstance(error, ValueError))))
        return
    commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
    try:
        replies.send(("ready", ready))
        threading.Thread(
            target=_receive_commands, args=(commands_in, commands), name="fitserve-commands", daemon=True
        ).start()
        _ProcessEngineLoop(engine, commands, replies).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return  # the server is gone; nobody to tell
    except BaseException as error:
        logger.exception("the engine process stopped")
        with contextlib.suppress(OSError):
            replies.send(Reply(died=portable_error(error)))
    finally:
        engine.shutdown()
