"""Which tensor-parallel rank and pipeline stage this process is, and the groups its collectives run on.

One process per rank (worker/tp_executor.py starts them): rank 0 is the engine's own process, ranks
1.. are worker processes. Each sets its rank once, before it builds the model, and the layers read it
as they are built (layers/linear.py, layers/vocab_embedding.py, models/decoder_blocks.py): a layer
built outside a parallel run sees rank 0 of 1 and holds the whole matrix, a model every layer.

With pipeline parallel the world is tensor_parallel_size x pipeline_parallel_size ranks: global rank
stage * tp + t is tensor-parallel rank t of stage `stage`, each stage has its own tensor-parallel group,
and a stage hands its hidden states to the same tensor-parallel rank of the next stage
(distributed/pipeline.py).

The groups are NCCL on CUDA and gloo on the CPU (the same code, so CI runs both kinds on CPUs).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
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
    first_global_rank: int = 0  # the group's rank 0 as the world numbers it (its stage's first rank)
    # distributed/custom_all_reduce.CustomAllReduce where the group's GPUs run it, else None (NCCL / gloo)
    custom_all_reduce: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class PipelineParallel:
    """This process's pipeline stage. The hidden states go to the same tensor-parallel rank of the
    neighbouring stages; the last stage's first rank sends the logits to global rank 0, which samples."""

    stage: int = 0
    size: int = 1
    tensor_parallel_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def previous_rank(self) -> int:
        return self.global_rank - self.tensor_parallel_size

    @property
    def next_rank(self) -> int:
        return self.global_rank + self.tensor_parallel_size

    @property
    def last_stage_first_rank(self) -> int:
        return (self.size - 1) * self.tensor_parallel_size

    @property
    def global_rank(self) -> int:
        return self.stage * self.tensor_parallel_size + _state.rank


_state = TensorParallel()
_pipeline = PipelineParallel()


def tp() -> TensorParallel:
    """This process's tensor-parallel rank, size and group (rank 0 of 1 outside a tensor-parallel run)."""
    return _state


def pp() -> PipelineParallel:
    """This process's pipeline stage (stage 0 of 1 outside a pipeline-parallel run)."""
    return _pipeline


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
    """init_model_parallel with one pipeline stage: `size` tensor-parallel ranks."""
    return init_model_parallel(rank, size, 1, address, device_type, while_waiting)


def init_model_parallel(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    address: str,
    device_type: str,
    while_waiting: Callable[[], None] | None = None,
    device_index: int | None = None,
    custom_all_reduce: bool = True,
) -> TensorParallel:
    """Joins the world of tensor_parallel_size x pipeline_parallel_size ranks at `address`
    (tcp://host:port) as global `rank`; every rank calls it with the same address. NCCL on CUDA (the
    rank's GPU is made current first: cuda:`device_index`, by default cuda:`rank`, one host's GPUs in
    rank order), gloo on the CPU. With several stages every rank then creates
    every stage's tensor-parallel group (torch wants all ranks in each new_group call, in one order)
    and keeps its own.

    Rank 0 holds the rendezvous store and waits until every other rank has reached it, calling
    `while_waiting` (which raises to give up: a rank died while starting) every 0.1 s; only then do all
    join the group, so a rank that dies early never leaves rank 0 in torch's rendezvous, which cannot be
    interrupted and blocks every later one in the process.

    On GPUs, with `custom_all_reduce` (not --disable-custom-all-reduce), each tensor-parallel group then
    sets up distributed/custom_all_reduce.py for its small sums where all of its GPUs can run it."""
    global _state, _pipeline
    size = tensor_parallel_size * pipeline_parallel_size
    if size == 1:
        _state, _pipeline = TensorParallel(), PipelineParallel()
        return _state
    backend = "nccl" if device_type == "cuda" else "gloo"
    options: dict[str, Any] = {}
    if device_type == "cuda":
        device = torch.device("cuda", rank if device_index is None else device_index)
        torch.cuda.set_device(device)
        options["device_id"] = device
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
    if pipeline_parallel_size == 1:
        custom = _custom_all_reduce(custom_all_reduce, device_type, dist.group.WORLD, rank, size, timeout)
        _state, _pipeline = TensorParallel(rank, size, dist.group.WORLD, 0, custom), PipelineParallel()
        return _state
    stage, tp_rank = divmod(rank, tensor_parallel_size)
    group = None
    for each in range(pipeline_parallel_size):
        members = list(range(each * tensor_parallel_size, (each + 1) * tensor_parallel_size))
        made = dist.new_group(members, timeout=timeout) if tensor_parallel_size > 1 else None
        if each == stage:
            group = made
    custom = None
    if group is not None:
        wanted = custom_all_reduce
        custom = _custom_all_reduce(wanted, device_type, group, tp_rank, tensor_parallel_size, timeout)
    _state = TensorParallel(tp_rank, tensor_parallel_size, group, stage * tensor_parallel_size, custom)
    _pipeline = PipelineParallel(stage, pipeline_parallel_size, tensor_parallel_size)
    return _state


def _custom_all_reduce(
    wanted: bool, device_type: str, group: Any, rank: int, size: int, timeout: datetime.timedelta
) -> Any:
    """The group's custom all-reduce (every rank of it calls this at once), or None: not wanted, not
    CUDA, or not runnable on every one of the group's GPUs."""
    if not wanted or device_type != "cuda":
        return None
    from fitserve.distributed.custom_all_reduce import CustomAllReduce

    device = torch.device("cuda", torch.cuda.current_device())
    return CustomAllReduce.create(group, rank, size, device, timeout.total_seconds())


def set_tensor_parallel(state: TensorParallel) -> None:
    """Sets the rank directly (tests that build one rank's layers without a group)."""
    global _state
    _state = state


def set_pipeline_parallel(state: PipelineParallel) -> None:
    """Sets the stage directly (tests that build one stage's model without a group)."""
    global _pipeline
    _pipeline = state


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Makes tp() and pp() report rank 0 of 1 inside: a drafter that lives on rank 0's device alone
    (spec_decode/draft_model.py) is built whole and runs without collectives there, beside a
    tensor-parallel target. Nothing of the target may run inside (its collectives would be skipped)."""
    global _state, _pipeline
    saved = _state, _pipeline
    _state, _pipeline = TensorParallel(), PipelineParallel()
    try:
        yield
    finally:
        _state, _pipeline = saved


def destroy_tensor_parallel() -> None:
    """Leaves the world (an aborted one too) and makes this process rank 0 of 1, stage 0 of 1 again."""
    global _state, _pipeline
    joined = _state.group is not None or _pipeline.size > 1
    _state, _pipeline = TensorParallel(), PipelineParallel()
    if joined and dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()


def forget_tensor_parallel() -> None:
    """Makes this process rank 0 of 1 again without touching the group (one that would not close)."""
    global _state, _pipeline
    _state, _pipeline = TensorParallel(), PipelineParallel()


def abort_tensor_parallel() -> None:
    """Unblocks this rank's collectives after another rank died: they raise instead of waiting for the
    timeout. Called from a monitor thread; the group is unusable afterwards. With pipeline stages the
    whole world is aborted (every stage's group with it): a stage may wait in a send or receive."""
    group = _state.group
    if _state.custom_all_reduce is not None:  # its kernels wait for the dead rank outside NCCL
        _state.custom_all_reduce.abort()
    if _pipeline.size > 1 and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch's way to abort a group
    with contextlib.suppress(AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        if abort is not None:
            abort(group)
            return
        if torch.cuda.is_available():
            group._get_backend(torch.device("cuda")).abort()
