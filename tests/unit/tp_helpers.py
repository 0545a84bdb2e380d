"""Runs a function on several tensor-parallel ranks of a gloo group on the CPU, one process each.

`run_ranks(fn, size, *args)` starts `size` processes (spawn), each joins the group as its rank
(fitserve.distributed.parallel_state.init_tensor_parallel) and returns fn(rank, *args); the results
come back in rank order. fn must be a module-level function (it is pickled by name) and return
something picklable (tensors are fine). A rank that raises fails the call with its traceback.
"""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any], rank: int, size: int, address: str, args: tuple, results: Any, device_type: str
) -> None:
    import torch

    from fitserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, size, address, device_type)
        # by value: torch would share tensors through file descriptors that die with the process
        results.put((rank, True, pickle.dumps(fn(rank, *args))))
    except BaseException:  # noqa: BLE001 - reported to the test with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_tensor_parallel()


def run_ranks(
    fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = 240.0, device_type: str = "cpu"
) -> list[Any]:
    """`device_type` "cuda": rank r on cuda:r, in an NCCL group (with the custom all-reduce where it runs)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        context.Process(
            target=_rank_main, args=(fn, rank, size, address, args, results, device_type), daemon=True
        )
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    by_rank: dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            by_rank[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [by_rank[rank] for rank in range(size)]


class on_rank:  # noqa: N801 - used as `with on_rank(r, n):`
    """tp() as rank r of n (no group) inside the block, for building one rank's model or layers in this
    process."""

    def __init__(self, rank: int, size: int) -> None:
        from fitserve.distributed.parallel_state import TensorParallel

        self.state = TensorParallel(rank, size)

    def __enter__(self) -> None:
        from fitserve.distributed.parallel_state import set_tensor_parallel

        set_tensor_parallel(self.state)

    def __exit__(self, *exc: object) -> None:
        from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel

        set_tensor_parallel(TensorParallel())
