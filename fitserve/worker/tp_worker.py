"""The main function of a rank other than the first (worker/tp_executor.py starts it).

It runs in a process of its own (the mp backend) or in a Ray actor (worker/ray_ranks.py). It joins the
group, builds its ModelRunner (its part of every layer of its pipeline stage's layers) and,
with method mtp, its shard of the MTP layer (worker/draft_steps.py), and then runs what the first rank
sends, in order, over its own pipe: size the KV cache, allocate it, run a step (the first rank's host
inputs), run a drafter forward, stop. Messages are pickled once by the sender (bytes); replies go back on
a second pipe. An error is sent back with its traceback and the process exits; the process also exits
when the engine's process is gone.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

# Messages to a rank: (kind, payload)
SIZE_KV_CACHE = "size_kv_cache"
ALLOCATE_KV_CACHE = "allocate_kv_cache"
STEP = "step"
DRAFT_STEP = "draft_step"  # a forward of the MTP drafter (worker/draft_steps.py)
STOP = "stop"
# Replies from a rank
LOADED = "loaded"
PLANNED = "planned"
ALLOCATED = "allocated"
FAILED = "failed"


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _configure_logging(rank: int) -> None:
    # The first rank logs the engine's lines; the others only what goes wrong, marked with their rank.
    logger = logging.getLogger("fitserve")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s fitserve rank {rank}: %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.WARNING)
    logger.propagate = False


def run_rank(
    config: Any,
    rank: int,
    size: int,
    address: str,
    commands: Connection,
    replies: Connection,
    parent_pid: int,
    device_index: int | None = None,
    exit_process: Callable[[int], Any] = os._exit,
) -> None:
    """`device_index`: this rank's GPU among those this process sees (None: cuda:`rank`, the mp backend's
    one host; a Ray actor passes the one Ray gave it). `commands` and `replies` may be one duplex
    connection (a TCP connection back to the engine under the Ray backend, worker/ray_ranks.py).
    `exit_process(code)` ends the rank once it stops or fails: os._exit for a process of its own; a Ray
    actor ends its run instead and Ray ends the actor."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    # `kill -USR1 <pid>` prints where every thread of a rank is (to find what a hung collective waits on)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _configure_logging(rank)
    try:
        import torch

        from fitserve.distributed.parallel_state import init_model_parallel
        from fitserve.worker.draft_steps import rank_drafter
        from fitserve.worker.model_runner import ModelRunner

        device_type = config.device.torch_device.type
        if device_type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        parallel = config.parallel
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != size:
            raise ValueError(f"{size} ranks started for {parallel}: a fitserve bug")
        init_model_parallel(
            rank,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            address,
            device_type,
            device_index=device_index,
            custom_all_reduce=not parallel.disable_custom_all_reduce,
        )
        runner = ModelRunner(config)
        drafter = rank_drafter(config, runner)  # the MTP layer's shard, counted in the KV cache sizing
        replies.send_bytes(pickle.dumps((LOADED, runner.weight_bytes)))
        while True:
            kind, payload = pickle.loads(commands.recv_bytes())
            if kind == STEP:
                runner.run_host_inputs(payload)
            elif kind == DRAFT_STEP:
                drafter.run(payload)
            elif kind == SIZE_KV_CACHE:
                replies.send_bytes(pickle.dumps((PLANNED, runner.size_kv_cache())))
            elif kind == ALLOCATE_KV_CACHE:
                runner.allocate_kv_cache(payload)
                if drafter is not None:
                    drafter.allocate_kv_cache(payload.num_kv_blocks)
                replies.send_bytes(pickle.dumps((ALLOCATED, None)))
            elif kind == STOP:
                runner.release_graphs()
                break
    except (EOFError, BrokenPipeError, ConnectionResetError):
        exit_process(0)  # the engine is gone
    except BaseException as error:  # noqa: BLE001 - sent to the first rank, which stops the engine
        reason = f"{type(error).__name__}: {error}"
        logging.getLogger("fitserve").error("rank %d failed: %s\n%s", rank, reason, traceback.format_exc())
        try:
            replies.send_bytes(pickle.dumps((FAILED, reason)))
        finally:
            exit_process(1)
    exit_process(0)
