"""fitserve's own all-reduce for the small sums of a tensor-parallel decode step, on GPUs of one machine.

`CustomAllReduce.create` sets it up once the tensor-parallel group exists (distributed/parallel_state.py):
every rank allocates its buffers and flags in torch's symmetric memory (the same allocation mapped into
every rank's address space, over NVLink or PCIe peer access). In the forwards the model runner's graph
runners warm up and capture (decode steps, prompt pieces: collectives.graph_forwards),
distributed/collectives.py then sends a sum of at most MAX_BYTES here (kernels/one_shot_all_reduce.py) and
anything larger to NCCL, and a sum followed by the residual add and an RMSNorm (a decoder's norms after
o_proj and down_proj) to kernels/one_shot_all_reduce_norm.py. Eager steps keep NCCL (collectives._in_graph
says why).

Whether it is used is one decision of the whole group: every rank must take the same path for every
call, so a rank on which it cannot run (no peer access between two of the GPUs, ranks on several
machines or seeing different GPUs) turns it off for all, and the log says why; a setup that fails past
that check stops the start, naming `--disable-custom-all-reduce`, which turns it off as in vLLM.

A rank that dies while the others wait in the kernel: the engine's monitor thread calls `abort()`
(parallel_state.abort_tensor_parallel), which sets this rank's `abort` word from a stream of its own, so
the waiting programs end; the executor then refuses the step (worker/tp_executor.py `_guarded`). With no
abort, the kernel gives up at the collective timeout (FITSERVE_DIST_TIMEOUT_S) with a CUDA error.

Measured on 2 x H200 (benchmarks/results/h200x2_tp.json): in a CUDA graph 5.3 us a call at 8 KB against
NCCL's 7.8; Llama-3.1-8B TP 2 batch 1 298.9 -> 341.8 tok/s with the fused norms and the TP weights' GEMM
rule.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from fitserve.kernels import one_shot_all_reduce as kernel
from fitserve.kernels import one_shot_all_reduce_norm as norm_kernel

logger = logging.getLogger("fitserve")

# Messages up to this many bytes come here; larger ones go to NCCL (prefill steps). Decode steps send
# rows x hidden x 2 bytes: 8 KB a row at hidden 4096, so up to 64 rows of Llama-3.1-8B.
MAX_BYTES = 512 << 10
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Whether this process has set up symmetric memory before (an earlier engine in it). torch numbers its
# symmetric-memory exchanges per process, so a second setup in the engine's process (rank 0) would wait
# for keys that the freshly started ranks number from zero: measured on two H200s, the second tensor-
# parallel engine of a process hung at start. Such an engine uses NCCL instead.
_set_up_in_this_process = False


def _mapped(size: int) -> int:
    """Bytes the driver maps for a symmetric-memory allocation of `size` (its 2 MiB granularity)."""
    return -(-size // (2 << 20)) * (2 << 20)


class _Channel:
    """One kernel's buffers: `flags[s]` (int64, programs x world) and `data[dtype][s]` (2 parities x world x
    slot elements) of every rank s as this rank addresses them, in symmetric memory, and this rank's
    `counters` (int64, one a program). The two kernels each have their own, so a program of one never
    touches what a program of the other may still read."""

    def __init__(
        self, group_name: str, world: int, device: torch.device, programs: int, slot_bytes: int, dtypes
    ) -> None:
        import torch.distributed._symmetric_memory as symmetric_memory

        self._flags = symmetric_memory.empty(programs * world, dtype=torch.int64, device=device)
        self._flags.zero_()  # before the group's barrier (CustomAllReduce.create): no flag is raised yet
        self._data = symmetric_memory.empty(2 * world * slot_bytes, dtype=torch.uint8, device=device)
        flags = symmetric_memory.rendezvous(self._flags, group_name)
        data = symmetric_memory.rendezvous(self._data, group_name)
        self.flags = [flags.get_buffer(peer, (programs * world,), torch.int64) for peer in range(world)]
        self.data = {
            dtype: [
                data.get_buffer(peer, (2 * world * slot_bytes // dtype.itemsize,), dtype)
                for peer in range(world)
            ]
            for dtype in dtypes
        }
        self.counters = torch.zeros(programs, dtype=torch.int64, device=device)
        # what symmetric memory holds for it on this GPU, outside torch's allocator (mapped in 2 MiB pieces)
        self.device_bytes = _mapped(self._flags.numel() * 8) + _mapped(self._data.numel())


class CustomAllReduce:
    def __init__(self, group: Any, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        global _set_up_in_this_process
        self.rank, self.world, self.device = rank, world, device
        _set_up_in_this_process = True  # before the first exchange: one that fails counts too
        self.timeout_ns = int(timeout_s * 1e9)
        pieces = kernel.MAX_PROGRAMS * kernel.CHUNK
        self._plain = _Channel(group.group_name, world, device, kernel.MAX_PROGRAMS, pieces * 4, DTYPES)
        rows = norm_kernel.MAX_ROWS
        row_bytes = rows * norm_kernel.ROW_SLOT * 2  # 16-bit rows
        norm_dtypes = (torch.bfloat16, torch.float16)
        self._norm = _Channel(group.group_name, world, device, rows, row_bytes, norm_dtypes)
        # the memory baseline of the engine's platform leaves this out (it is the engine's own)
        self.device_bytes = self._plain.device_bytes + self._norm.device_bytes
        self._abort = torch.zeros(1, dtype=torch.int32, device=device)
        self._abort_stream = torch.cuda.Stream(device=device)
        torch.cuda.synchronize(device)  # the flags are zero before any peer may raise one

    @classmethod
    def create(
        cls, group: Any, rank: int, world: int, device: torch.device, timeout_s: float
    ) -> CustomAllReduce | None:
        """The group's custom all-reduce, or None where some rank cannot take part (the reason logged once).
        Every rank of the group calls it at once, and all get the same answer."""
        reason = _why_not(group, rank, world, device)
        if reason is not None:
            if rank == 0:
                logger.info("Custom all-reduce off: %s; tensor-parallel sums go through NCCL", reason)
            return None
        try:
            custom = cls(group, rank, world, device, timeout_s)
        except (RuntimeError, AttributeError, ImportError, ValueError) as error:
            raise RuntimeError(
                f"tensor-parallel rank {rank} could not set up the custom all-reduce's symmetric memory "
                f"({type(error).__name__}: {error}): run with --disable-custom-all-reduce"
            ) from error
        dist.barrier(group=group)  # every rank's flags are zero before anyone's first call
        if rank == 0:
            logger.info(
                "Custom all-reduce on: sums of up to %d KB in the CUDA graphs go over peer memory "
                "between the %d GPUs (--disable-custom-all-reduce: NCCL)",
                MAX_BYTES >> 10,
                world,
            )
        return custom

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes through this all-reduce (small, contiguous, a 16/32-bit float on this GPU)."""
        return (
            x.dtype in self._plain.data
            and x.numel() * x.element_size() <= MAX_BYTES
            and x.is_contiguous()
            and x.device == self.device
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place; returns x."""
        return kernel.one_shot_all_reduce(
            x,
            self.rank,
            self._plain.data[x.dtype],
            self._plain.flags,
            self._plain.counters,
            self._abort,
            self.timeout_ns,
        )

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether add_rms_norm takes these (a decode step's rows: kernels/one_shot_all_reduce_norm.takes)."""
        return x.device == self.device and norm_kernel.takes(x, residual, weight)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual <- (sum over the ranks of x) + residual, x <- RMSNorm of that; returns
        (x, residual)."""
        return norm_kernel.one_shot_all_reduce_norm(
            x,
            residual,
            weight,
            eps,
            self.rank,
            self._norm.data[x.dtype],
            self._norm.flags,
            self._norm.counters,
            self._abort,
            self.timeout_ns,
        )

    def abort(self) -> None:
        """Ends this rank's waits for the others (a rank died): its kernels stop waiting and leave garbage,
        which the executor never returns (it refuses the step). Called from a monitor thread."""
        with contextlib.suppress(RuntimeError), torch.cuda.stream(self._abort_stream):
            self._abort.fill_(1)


def _why_not(group: Any, rank: int, world: int, device: torch.device) -> str | None:
    """Why the group cannot use it (the same answer on every rank), or None. Symmetric memory maps the GPUs
    of one machine into each other's address space: every rank must be on one host and reach every other
    rank's GPU (peer access)."""
    if device.type != "cuda":
        return "not on CUDA"
    if not 2 <= world <= kernel.MAX_WORLD:
        return f"{world} ranks (it takes 2 to {kernel.MAX_WORLD})"
    placement: list[Any] = [None] * world
    dist.all_gather_object(
        placement, (socket.gethostname(), device.index, torch.cuda.device_count()), group=group
    )
    problem = None
    if len({host for host, _, _ in placement}) > 1:
        problem = "the ranks run on more than one machine"
    elif (
        any(count != torch.cuda.device_count() for _, _, count in placement)
        or len({index for _, index, _ in placement}) < world
    ):  # Ray gives each rank's actor only its own GPU
        problem = "the ranks see different sets of GPUs"
    else:
        blocked = [
            index
            for _, index, _ in placement
            if index != device.index and not torch.cuda.can_device_access_peer(device.index, index)
        ]
        if blocked:
            problem = f"GPU {device.index} has no peer access to GPU {blocked[0]}"
        elif _set_up_in_this_process:
            problem = (
                "an earlier engine of this process set up torch's symmetric memory, which a second "
                "setup here cannot meet (a new process starts with it)"
            )
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    found = next(((r, p) for r, p in enumerate(problems) if p is not None), None)
    return None if found is None else f"{found[1]} (rank {found[0]})"
