"""What crosses the pipes between the engine process and the server (engine_process.py, the parent's side;
engine_process_child.py, the child's): what the child sends once its engine is built (EngineReady), each
round's Reply, errors made fit to cross (portable_error), and the pipes' size."""

from __future__ import annotations

import contextlib
import fcntl
import pickle
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from fitserve.core.outputs import RequestOutput
from fitserve.engine.output_deltas import WireOutput

_F_SETPIPE_SZ = 1031  # Linux: 1 MiB pipes, so neither side waits for the other to read a burst
_PIPE_BYTES = 1 << 20


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
    """One message from the engine process. `outputs` travel as deltas in plain tuples (output_deltas.py);
    the server's receiver thread turns them back into cumulative RequestOutputs, in place, before anyone
    sees them."""

    accepted: list[tuple[str, BaseException | None]] = field(default_factory=list)
    outputs: list[WireOutput] | list[RequestOutput] | None = None
    failed: tuple[list[str], BaseException] | None = None
    stats: Any = None
    died: BaseException | None = None  # the engine loop raised; the process exits
    forgotten: list[str] = field(default_factory=list)  # requests aborted or failed in the engine


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


def widen_pipe(connection: Connection) -> None:
    with contextlib.suppress(OSError):
        fcntl.fcntl(connection.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
