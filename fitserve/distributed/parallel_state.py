"""Which tensor-parallel rank this process is, and the process group its collectives run on.

One process per rank (worker/tp_executor.py starts them): rank 0 is the engine's own process, ranks
1.. are worker processes. Each sets its rank once, before it builds the model, and the layers read it
as they are built (layers/linear.py, layers/vocab_embedding.py): a layer built outside a
tensor-parallel run sees rank 0 of 1 and holds the whole matrix.

The group is NCCL on CUDA and gloo on the CPU (the same code, so CI runs tensor parallel on CPUs).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a collective may wait for a rank before it fails (seconds): a rank that died or hangs stops
# the engine with its rank named instead of hanging it.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "FITSERVE_DIST_TIMEOUT_S"


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None for size 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0


_state = TensorParallel()


def tp() -> TensorParallel:
    """This process's tensor-parallel rank, size and group (rank 0 of 1 outside a tensor-parallel run)."""
    return _state


def collective_timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds: set it to e.g. 600") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} must be positive: set it to e.g. 600")
    return seconds


def init_tensor_parallel(
    rank: int, size: int, address: str, device_type: str, while_waiting: Callable[[], None] | None = None
) -> TensorParallel:
    """Joins the group of `size` ranks at `address` (tcp://host:port) as `rank`; every rank calls it with
    the same address. NCCL on CUDA (the rank's GPU is made current first), gloo on the CPU.

    Rank 0 holds the rendezvous store and waits until every other rank has reached it, calling
    `while_waiting` (which raises to give up: a rank died while starting) every 0.1 s; only then do all
    join the group, so a rank that dies early never leaves rank 0 in torch's rendezvous, which cannot be
    interrupted and blocks every later one in the process."""
    global _state
    if size == 1:
        _state = TensorParallel()
        return _state
    backend = "nccl" if device_type == "cuda" else "gloo"
    options: dict[str, Any] = {}
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        options["device_id"] = torch.device("cuda", rank)
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    arrived = [f"fitserve/arrived/{other}" for other in range(1, size)]
    if rank == 0:
        while not store.check(arrived):
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.1)
    else:
        store.set(f"fitserve/arrived/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **options)
    _state = TensorParallel(rank, size, dist.group.WORLD)
    return _state


def set_tensor_parallel(state: TensorParallel) -> None:
    """Sets the rank directly (tests that build one rank's layers without a group)."""
    global _state
    _state = state


def destroy_tensor_parallel() -> None:
    """Leaves the group (an aborted one too) and makes this process rank 0 of 1 again."""
    global _state
    group, _state = _state.group, TensorParallel()
    if group is not None and dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()


def forget_tensor_parallel() -> None:
    """Makes this process rank 0 of 1 again without touching the group (one that would not close)."""
    global _state
    _state = TensorParallel()


def abort_tensor_parallel() -> None:
    """Unblocks this rank's collectives after another rank died: they raise instead of waiting for the
    timeout. Called from a monitor thread; the group is unusable afterwards."""
    group = _state.group
    if group is None:
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch's way to abort a group
    with contextlib.suppress(AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        if abort is not None:
            abort(group)
            return
        if torch.cuda.is_available():
            group._get_backend(torch.device("cuda")).abort()
