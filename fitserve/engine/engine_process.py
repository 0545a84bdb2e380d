"""The engine in a process of its own, beside the server's event loop (the process backend of AsyncEngine).

Why: in one process the engine thread and the event loop (one SSE chunk per token per request: pydantic,
starlette, h11) share the GIL, and the engine waits for it between steps while the GPU idles. Here the
Engine runs in a child process (started with "spawn": a fork after CUDA is up is not safe) and the server
process keeps only the HTTP side, as vLLM's engine core does.

The child (engine_process_child.py) builds the Engine and runs the same `EngineLoop` as the engine thread;
what crosses the pipes is in engine_process_pipe.py, the outputs as deltas (output_deltas.py).

The parent (`EngineProcess`): starts the child, waits for it to be ready (a startup error is raised here
as the child raised it: a ValueError stays a ValueError), loads the tokenizer with the engine's own
function while the child loads the model, and holds what the server reads from the engine (config, memory
plan, generation defaults, eos ids). AsyncEngine sends commands through `send()` and a receiver thread of
its own reads `receive()`.

Signals: the child ignores SIGINT (a Ctrl-C reaches the whole process group): the server shuts down,
ends in-flight requests with their aborted outputs, then sends a stop; `stop()` kills the child if it
does not exit in time. The child exits by itself when the server process goes away.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

from fitserve.engine.engine_loop import STOP
from fitserve.engine.engine_process_child import run_engine_process
from fitserve.engine.engine_process_pipe import EngineReady, Reply, widen_pipe
from fitserve.engine.output_deltas import OutputDecoder

logger = logging.getLogger(__name__)


class EngineProcessError(RuntimeError):
    """The engine process exited when it should not have."""


class EngineProcess:
    """The server's handle on the engine process; AsyncEngine(EngineProcess.start(...)) serves from it.

    It has what the server reads from an Engine (config, tokenizer, memory_plan, generation_defaults,
    eos_token_ids, default_sampling_params(), get_stats() before the start) and no output_processor."""

    runs_in_process = True

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        commands: Connection,
        replies: Connection,
        config: Any,
        tokenizer: Any,
        ready: EngineReady,
    ) -> None:
        self.process = process
        self._commands = commands
        self._replies = replies
        self._send_lock = threading.Lock()
        self._decoder = OutputDecoder()  # the receiver thread's alone
        self.config = config
        self.tokenizer = tokenizer
        self.memory_plan = ready.memory_plan
        self.generation_defaults = ready.generation_defaults
        self.eos_token_ids = ready.eos_token_ids
        self.peak_rss_bytes = ready.peak_rss_bytes
        self._default_params = ready.default_sampling_params
        self._stats = ready.stats

    @classmethod
    def start(
        cls,
        engine_args: Any,
        *,
        serving: bool = False,
        decode_logprob_tokens: bool = True,
        visible_devices: str | None = None,
    ) -> EngineProcess:
        """Starts the engine process and waits until its engine is built; its startup error (bad settings,
        a missing model, out of memory) is raised here, and the process is gone. `visible_devices`: the
        process's CUDA_VISIBLE_DEVICES (a data-parallel replica's GPUs)."""
        context = multiprocessing.get_context("spawn")
        commands_in, commands = context.Pipe(duplex=False)
        replies, replies_out = context.Pipe(duplex=False)
        process = context.Process(
            target=run_engine_process,
            args=(
                engine_args,
                serving,
                decode_logprob_tokens,
                commands_in,
                replies_out,
                os.getpid(),
                visible_devices,
            ),
            name="fitserve-engine",
            daemon=True,
        )
        process.start()
        widen_pipe(commands)  # a burst of long prompts must not block the event loop's sends
        commands_in.close()
        replies_out.close()
        try:
            config = _wait_for(process, replies, "config")
            tokenizer = _load_tokenizer(config)  # while the engine process loads the model
            ready = _wait_for(process, replies, "ready")
        except BaseException:
            _end(process)
            commands.close()
            replies.close()
            raise
        return cls(process, commands, replies, config, tokenizer, ready)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def default_sampling_params(self) -> Any:
        return self._default_params

    def get_stats(self) -> Any:
        return self._stats

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def send(self, command: Any) -> None:
        with self._send_lock:
            self._commands.send(command)

    def receive(self) -> Reply:
        """The next reply, its outputs cumulative again; EOFError once the process is gone. One thread
        only (AsyncEngine's receiver)."""
        reply: Reply = self._replies.recv()
        if reply.forgotten:
            self._decoder.forget(reply.forgotten)
        if reply.outputs:
            self._decoder.decode(reply.outputs)
        return reply

    def death_error(self) -> EngineProcessError:
        return EngineProcessError(
            f"the engine process (pid {self.process.pid}) {_how_it_ended(self.process)}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the process: a stop command (a no-op if one was sent), up to timeout_s for it to finish
        its step and exit, then a kill. Safe to call twice."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._commands.send(STOP)
        _end(self.process, timeout_s)
        with self._send_lock:
            self._commands.close()


def _wait_for(process: multiprocessing.process.BaseProcess, replies: Connection, kind: str) -> Any:
    """The child's next startup message (`kind`); its error raised; its death without a word (the
    kernel's out-of-memory killer, a crash in native code) an EngineProcessError, never a hang."""
    while not replies.poll(0.2):
        if not process.is_alive() and not replies.poll(0):
            break
    try:
        message_kind, payload = replies.recv()
    except EOFError:  # it exited without a message
        raise EngineProcessError(
            f"the engine process {_how_it_ended(process)} while starting (out of host memory?): the log "
            "above says how far it got"
        ) from None
    if message_kind == "error":
        raise payload
    assert message_kind == kind, (message_kind, kind)
    return payload


def _how_it_ended(process: multiprocessing.process.BaseProcess) -> str:
    process.join(5.0)
    code = process.exitcode
    return f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"


def _load_tokenizer(config: Any) -> Any:
    """The tokenizer as the Engine loads it (fitserve/engine/engine.py)."""
    from fitserve.models.loader import load_tokenizer
    from fitserve.models.resolve import resolve_tokenizer_path
    from fitserve.token_bytes import token_byte_table

    model = config.model
    folder = resolve_tokenizer_path(model.tokenizer, model.tokenizer_revision)
    tokenizer = load_tokenizer(folder, model.trust_remote_code, model.tokenizer_mode != "slow")
    token_byte_table(tokenizer)
    return tokenizer


def _end(process: multiprocessing.process.BaseProcess, timeout_s: float = 0.0) -> None:
    """The process exited, or is killed."""
    process.join(timeout_s)
    if process.is_alive():
        if timeout_s:
            logger.warning("the engine process did not exit within %.0f s: killing it", timeout_s)
        process.kill()
        process.join(10.0)
