"""The engine in a process of its own, beside the server's event loop (the process backend of AsyncEngine).

Why: in one process the engine thread and the event loop (one SSE chunk per token per request: pydantic,
starlette, h11) share the GIL, and the engine waits for it between steps while the GPU idles. Here the
Engine runs in a child process (started with "spawn": a fork after CUDA is up is not safe) and the server
process keeps only the HTTP side, as vLLM's engine core does.

The child (`run_engine_process`): resolves the config from the EngineArgs (the planner's lines log from
here, so the server process never touches the GPU), builds the Engine, then runs the same `EngineLoop` as
the engine thread. A receiver thread moves commands (add, abort, stop) from the pipe into the loop's queue,
so the server's sends never wait for a step. Each round sends at most two replies, each one pickled
message: the acceptances (or the engine's ValueError) of the requests just added, then the step's outputs
with the stats after it.

The parent (`EngineProcess`): starts the child, waits for it to be ready (a startup error is raised here
as the child raised it: a ValueError stays a ValueError), loads the tokenizer with the engine's own
function while the child loads the model, and holds what the server reads from the engine (config, memory
plan, generation defaults, eos ids). AsyncEngine sends commands through `send()` and a receiver thread of
its own reads `receive()`.

Signals: the child ignores SIGINT (a Ctrl-C reaches the whole process group): the server shuts down,
ends in-flight requests with their aborted outputs, then sends a stop; `stop()` kills the child if it
does not exit in time. The child exits by itself when the server process goes away (its pipe closes, or
its parent changes), so no engine process outlives its server.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import pickle
import queue
import resource
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from fitserve.core.outputs import RequestOutput
from fitserve.engine.async_engine import _STOP, EngineLoop, _AbortCommand, _AddCommand

logger = logging.getLogger(__name__)

_F_SETPIPE_SZ = 1031  # Linux: 1 MiB pipes, so neither side waits for the other to read a burst
_PIPE_BYTES = 1 << 20
_PARENT_WATCH_S = 1.0


class EngineProcessError(RuntimeError):
    """The engine process exited when it should not have."""


@dataclass
class EngineReady:
    """What the server reads from the engine, sent once the engine is built."""

    memory_plan: Any
    generation_defaults: dict
    eos_token_ids: frozenset[int]
    default_sampling_params: Any
    stats: Any
    peak_rss_bytes: int


@dataclass
class Reply:
    """One message from the engine process. `outputs` travel as deltas (see OutputEncoder); the server's
    receiver thread turns them back into cumulative RequestOutputs before anyone sees them."""

    accepted: list[tuple[str, BaseException | None]] = field(default_factory=list)
    outputs: list[RequestOutput] | None = None
    failed: tuple[list[str], BaseException] | None = None
    stats: Any = None
    died: BaseException | None = None  # the engine loop raised; the process exits
    forgotten: list[str] = field(default_factory=list)  # requests aborted or failed in the engine


# ---- outputs over the pipe: deltas ------------------------------------------------------------------
#
# A RequestOutput is cumulative: every step repeats the prompt's ids and every token and logprob so far.
# Pickled whole, 128 requests with 640-token prompts and 160 tokens out make a 430 kB message (3.7 ms to
# pickle on the engine's critical path, 5 ms to unpickle under the server's GIL on a 2-core CPU). Over the
# pipe a request's output carries its prompt ids once (None after) and, per choice, only the token ids
# and logprobs it did not send before; the text (one string) and the rest go as they are. Both sides keep
# a small state per request, dropped when it finishes or is aborted (the engine says which in
# `Reply.forgotten`). Output kinds are CUMULATIVE or FINAL_ONLY, so what was sent is always a prefix.


class OutputEncoder:
    """The engine process's side: turns the step's fresh RequestOutputs into deltas, in place (the
    engine keeps no reference to them)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}  # request -> choice -> (tokens, logprobs)

    def encode(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            sent = self._sent.get(output.request_id)
            if sent is None:
                sent = self._sent[output.request_id] = {}
            else:
                output.prompt_token_ids = None  # type: ignore[assignment]
            for choice in output.outputs:
                tokens, logprobs = sent.get(choice.index, (0, 0))
                new_tokens, new_logprobs = len(choice.token_ids), len(choice.logprobs or ())
                if tokens:
                    choice.token_ids = choice.token_ids[tokens:]
                if logprobs and choice.logprobs is not None:
                    choice.logprobs = choice.logprobs[logprobs:]
                sent[choice.index] = (new_tokens, new_logprobs)
            if output.finished:
                del self._sent[output.request_id]
        return outputs

    def forget(self, request_id: str) -> bool:
        return self._sent.pop(request_id, None) is not None


class OutputDecoder:
    """The server's side (its receiver thread): rebuilds cumulative RequestOutputs, each with lists of
    its own (a consumer may keep an earlier output while later ones arrive)."""

    def __init__(self) -> None:
        # request -> (prompt ids, choice -> (token ids, logprobs or None)), each list grown in place
        self._requests: dict[str, tuple[list[int], dict[int, tuple[list[int], list[Any] | None]]]] = {}

    def decode(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            if output.prompt_token_ids is not None:
                state = self._requests[output.request_id] = (output.prompt_token_ids, {})
            else:
                state = self._requests.get(output.request_id, ([], {}))  # absent: aborted meanwhile
                output.prompt_token_ids = state[0]
            choices = state[1]
            for choice in output.outputs:
                known = choices.get(choice.index)
                if known is None:
                    known = choices[choice.index] = ([], None if choice.logprobs is None else [])
                tokens, logprobs = known
                tokens.extend(choice.token_ids)
                choice.token_ids = tokens.copy()
                if logprobs is not None and choice.logprobs is not None:
                    logprobs.extend(choice.logprobs)
                    choice.logprobs = logprobs.copy()
            if output.finished:
                self._requests.pop(output.request_id, None)
        return outputs

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)


# ---- the child ---------------------------------------------------------------------------------------


def portable_error(error: BaseException, with_traceback: bool = False) -> BaseException:
    """`error`, or a stand-in of the nearest builtin type when it does not survive pickling (a custom
    exception whose __init__ takes other arguments). A ValueError stays a ValueError, so the server
    refuses bad settings as it does with the engine in process."""
    if with_traceback:
        with contextlib.suppress(Exception):
            error.add_note("In the engine process:\n" + "".join(traceback.format_exception(error)).rstrip())
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        kind: type[BaseException] = ValueError if isinstance(error, ValueError) else RuntimeError
        stand_in = kind(str(error) or type(error).__name__)
        for note in getattr(error, "__notes__", []):
            stand_in.add_note(note)
        return stand_in


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
        if isinstance(command, _AbortCommand):
            self._forgotten.extend(rid for rid in command.request_ids if self._encoder.forget(rid))

    def on_accepted(self, command: _AddCommand, error: BaseException | None) -> None:
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


def _widen_pipe(connection: Connection) -> None:
    with contextlib.suppress(OSError):
        fcntl.fcntl(connection.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)


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
        commands.put(_STOP)


def run_engine_process(
    engine_args: Any,
    serving: bool,
    decode_logprob_tokens: bool,
    commands_in: Connection,
    replies: Connection,
    parent_pid: int,
) -> None:
    """The engine process's main function."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid,), name="fitserve-parent", daemon=True
    )
    watch.start()
    _widen_pipe(replies)
    from fitserve.engine.engine import Engine
    from fitserve.logger import configure_default_logging
    from fitserve.planner.resolve import create_engine_config

    configure_default_logging()
    try:
        config = create_engine_config(engine_args, serving=serving)
        replies.send(("config", config))
        engine = Engine(config)
        engine.output_processor.decode_logprob_tokens = decode_logprob_tokens
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


# ---- the parent ----------------------------------------------------------------------------------------


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
        cls, engine_args: Any, *, serving: bool = False, decode_logprob_tokens: bool = True
    ) -> EngineProcess:
        """Starts the engine process and waits until its engine is built; its startup error (bad settings,
        a missing model, out of memory) is raised here, and the process is gone."""
        context = multiprocessing.get_context("spawn")
        commands_in, commands = context.Pipe(duplex=False)
        replies, replies_out = context.Pipe(duplex=False)
        process = context.Process(
            target=run_engine_process,
            args=(engine_args, serving, decode_logprob_tokens, commands_in, replies_out, os.getpid()),
            name="fitserve-engine",
            daemon=True,
        )
        process.start()
        _widen_pipe(commands)  # a burst of long prompts must not block the event loop's sends
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
            self._commands.send(_STOP)
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
    from fitserve.engine.token_bytes import token_byte_table
    from fitserve.models.loader import load_tokenizer
    from fitserve.models.resolve import resolve_tokenizer_path

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
