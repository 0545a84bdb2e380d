"""Tensor and pipeline parallel: one process per rank, the first in the engine's own process.

The first rank's ModelRunner plans each step on the host (worker/step_inputs.py) and hands the host
inputs to every other rank over a pipe (pickled once, a few KB for a decode step) before it queues its
own forward; all ranks then run the same forward, meeting in its all-reduces (NCCL on GPUs, gloo on
CPUs), and the first rank samples and broadcasts the sampled ids (ModelRunner.launch). The KV cache is
sized on every rank and the smallest pool wins, so every rank holds the same blocks.

With --pipeline-parallel-size P the world is tensor_parallel_size x P ranks, every one of which gets
each step's host inputs the same way; a stage runs its layers and hands its hidden states to the next
(worker/pipeline_stage.py), and the last stage's logits come back to the first rank, which samples.

Method mtp: the first rank's drafter sends each of its forwards the same way (`draft_channel`,
worker/draft_steps.py); no drafter forward runs between a step whose sampling is deferred and that sampling
(the other ranks broadcast the sampled ids right after the forward).

Where ranks 1.. run: spawned processes of this host (--distributed-executor-backend mp, the default), or
Ray actors on this machine or others (ray: worker/ray_ranks.py, whose RayRank has _Rank's interface); the
protocol below is the same.

A rank that dies or fails: a thread per rank reads its replies and sees the pipe close; it records
which rank and why, and aborts this process's group so a collective waiting for that rank returns at
once. The next step raises RankFailedError, which stops the engine (the server then answers 503).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import socket
import threading
import time
from typing import Any

import torch

from fitserve.config import EngineConfig
from fitserve.core.scheduler import SchedulerOutput
from fitserve.distributed.parallel_state import (
    abort_tensor_parallel,
    destroy_tensor_parallel,
    forget_tensor_parallel,
    init_model_parallel,
)
from fitserve.planner.memory import MemoryPlan
from fitserve.worker import tp_worker
from fitserve.worker.draft_steps import DraftChannel
from fitserve.worker.model_runner import LaunchedStep, ModelRunner, ModelRunnerOutput
from fitserve.worker.rank_failure import RankFailedError
from fitserve.worker.step_inputs import HostInputs

logger = logging.getLogger("fitserve")

# How long the first rank waits for another rank's reply to a start-up command (loading, profiling).
STARTUP_REPLY_TIMEOUT_S = 3600.0
# A step that raised: how long to wait for a rank's exit to show (its collective may fail first).
DEAD_RANK_WAIT_S = 2.0
LEAVE_GROUP_TIMEOUT_S = 5.0


def _free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_label(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """How errors name a rank: "tensor-parallel rank 1", or with stages "rank 3 (pipeline stage 1,
    tensor-parallel rank 1)"."""
    if pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    stage, tp_rank = divmod(rank, tensor_parallel_size)
    return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


class _Rank:
    """Another rank's process, its command pipe and the thread that reads its replies."""

    def __init__(self, context: Any, config: EngineConfig, rank: int, size: int, address: str) -> None:
        self.rank = rank
        parallel = config.parallel
        self.label = rank_label(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        commands_in, self.commands = context.Pipe(duplex=False)
        self._replies_in, replies_out = context.Pipe(duplex=False)
        self.process = context.Process(
            target=tp_worker.run_rank,
            args=(config, rank, size, address, commands_in, replies_out, os.getpid()),
            name=f"fitserve-rank-{rank}",
            daemon=True,
        )
        self.process.start()
        commands_in.close()
        replies_out.close()
        self.replies: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._reap_lock = threading.Lock()
        self.failure: str | None = None

    @property
    def sentinel(self) -> int:
        """Ready (multiprocessing.connection.wait) once the process has exited."""
        return self.process.sentinel

    def send(self, data: bytes) -> None:
        self.commands.send_bytes(data)

    def finish(self, timeout: float) -> None:
        """Waits up to `timeout` for the process to exit (after STOP), then kills it."""
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()

    def exit_reason(self) -> str:
        """Why the process is gone, once it is (waits up to 5 s for the exit status)."""
        multiprocessing.connection.wait([self.process.sentinel], timeout=5)
        deadline = time.monotonic() + 2.0
        with self._reap_lock:  # one thread reaps the status; another waiting at once would read None
            code = self.process.exitcode
            while code is None and time.monotonic() < deadline:  # closed its pipes, not yet reaped
                time.sleep(0.01)
                code = self.process.exitcode
        if code is not None and code < 0:
            return f"its process exited (exit code {code}: killed by signal {-code})"
        return f"its process exited (exit code {code})"

    def read_replies(self, on_failure: Any) -> None:
        read_rank_replies(self, self._replies_in, on_failure)


def read_rank_replies(rank: Any, connection: multiprocessing.connection.Connection, on_failure: Any) -> None:
    """Puts a rank's replies (_Rank, or ray_ranks.RayRank) on its queue until it reports a failure or its
    connection closes; `on_failure(rank, reason)` then gets why."""
    while True:
        try:
            kind, payload = pickle.loads(connection.recv_bytes())
        except (EOFError, OSError):
            on_failure(rank, rank.exit_reason())
            return
        if kind == tp_worker.FAILED:
            on_failure(rank, payload)
            return
        rank.replies.put((kind, payload))


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        tp_size, pp_size = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        size = tp_size * pp_size
        if pp_size > 1:  # stages run eagerly (worker/pipeline_stage.py): no graph memory is reserved
            compilation = dataclasses.replace(config.compilation, enforce_eager=True)
            config = dataclasses.replace(config, compilation=compilation)
        device_type = config.device.torch_device.type
        self._failure: str | None = None
        self._stopping = False
        self._sampling_pending = False  # a launched step's sampling is deferred and not queued yet
        # method mtp: the first rank's drafter runs each forward on every rank through this
        self.draft_channel = DraftChannel(
            self._send_draft_step, self._guarded, lambda: self._sampling_pending
        )
        self._failure_lock = threading.Lock()
        self._placement: Any = None  # the Ray cluster's placement of the ranks (ray backend only)
        first_device: int | None = None  # rank 0's GPU (None: cuda:0)
        backend = config.parallel.distributed_executor_backend
        if backend == "ray":
            from fitserve.worker.ray_ranks import RayPlacement

            self._placement = RayPlacement(config, size)  # a start it refuses leaves nothing behind
            address, first_device = self._placement.address, self._placement.first_rank_device
            self.ranks: list[Any] = []
            try:
                for rank in range(1, size):
                    self.ranks.append(self._placement.start_rank(config, rank, size, address))
            except BaseException:
                self._stopping = True
                for started in self.ranks:
                    started.finish(timeout=0)
                self._placement.close()
                raise
        else:
            address = f"tcp://127.0.0.1:{_free_local_port()}"
            context = multiprocessing.get_context("spawn")
            self.ranks = [_Rank(context, config, rank, size, address) for rank in range(1, size)]
        for rank in self.ranks:
            threading.Thread(
                target=rank.read_replies,
                args=(self._on_rank_failure,),
                name=f"fitserve-rank-{rank.rank}-replies",
                daemon=True,
            ).start()
        self._threads_before = torch.get_num_threads()
        if device_type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        logger.info(
            "%s: %d ranks (%s), rank 0 in this process, the others %s",
            "Tensor parallel" if pp_size == 1 else f"Pipeline parallel ({pp_size} stages x {tp_size})",
            size,
            "NCCL" if device_type == "cuda" else "gloo",
            "in Ray actors" if backend == "ray" else "in processes it started",
        )
        self.runner: ModelRunner | None = None
        # before multiprocessing's own exit handler ends the ranks (atexit runs the latest first)
        atexit.register(self.shutdown)
        try:
            # a rank that dies before it joins stops the wait with its reason (_check)
            init_model_parallel(
                0,
                tp_size,
                pp_size,
                address,
                device_type,
                while_waiting=self._check,
                device_index=first_device,
                custom_all_reduce=not config.parallel.disable_custom_all_reduce,
            )
            self.runner = ModelRunner(config)
            self.runner.step_sender = self._send_step
            for rank in self.ranks:
                self._reply(rank, tp_worker.LOADED)
        except BaseException:
            self.shutdown()  # a start that failed leaves no rank, group or thread setting behind
            raise

    # ---- failures ---------------------------------------------------------------------------------
    def _on_rank_failure(self, rank: _Rank, reason: str) -> None:
        with self._failure_lock:
            first = self._failure is None and not self._stopping
            if first:
                self._failure = f"{rank.label} failed: {reason}"
                logger.error("%s; stopping the engine", self._failure)
            for other in self.ranks:
                other.replies.put((tp_worker.FAILED, reason))
        if first:
            # on a thread of its own: an abort that blocks (NCCL) must not hold this reader or the lock
            threading.Thread(target=abort_tensor_parallel, name="fitserve-abort-group", daemon=True).start()

    def _check(self) -> None:
        if self._failure is not None:
            raise RankFailedError(self._failure)

    def _reply(self, rank: _Rank, expected: str) -> Any:
        try:
            kind, payload = rank.replies.get(timeout=STARTUP_REPLY_TIMEOUT_S)
        except queue.Empty:
            raise RankFailedError(f"{rank.label} did not answer ({expected})") from None
        self._check()
        if kind != expected:
            raise RankFailedError(f"{rank.label} answered {kind!r}, not {expected!r}")
        return payload

    def _send(self, message: tuple[str, Any]) -> None:
        self._check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in self.ranks:
            try:
                rank.send(data)
            except OSError:
                self._on_rank_failure(rank, rank.exit_reason())
                self._check()

    def _send_step(self, host: HostInputs) -> None:
        self._send((tp_worker.STEP, host))

    def _send_draft_step(self, host: HostInputs) -> None:
        self._send((tp_worker.DRAFT_STEP, host))

    # ---- the executor's interface -----------------------------------------------------------------
    def initialize_kv_cache(self) -> MemoryPlan:
        """Every rank sizes its KV cache; every rank allocates the smallest pool."""
        self._send((tp_worker.SIZE_KV_CACHE, None))
        plans = [self._guarded(self.runner.size_kv_cache)]
        plans += [self._reply(rank, tp_worker.PLANNED) for rank in self.ranks]
        plan = min(plans, key=lambda each: each.num_kv_blocks)
        self._send((tp_worker.ALLOCATE_KV_CACHE, plan))
        self._guarded(lambda: self.runner.allocate_kv_cache(plan))
        for rank in self.ranks:
            self._reply(rank, tp_worker.ALLOCATED)
        return plan

    def launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> LaunchedStep:
        launched = self._guarded(lambda: self.runner.launch(scheduler_output, defer_sampling))
        self._sampling_pending = defer_sampling

        def sample() -> None:
            try:
                self._guarded(launched.sample)
            finally:
                self._sampling_pending = False
            for work in self.draft_channel.after_sampling:  # the drafter's work held for this sampling
                self._guarded(work)

        def finish() -> ModelRunnerOutput:
            return self._guarded(launched.result)

        return LaunchedStep(finish, launched.needs_token_history, launched.must_sync, sample)

    def _guarded(self, work: Any) -> Any:
        """work(), with an error caused by a failed rank (a collective aborted) raised as that failure."""
        self._check()
        try:
            result = work()
            # a rank failed while this ran: its collectives were aborted and what it returns is garbage
            self._check()
            return result
        except RankFailedError:
            raise
        except Exception as error:
            if self._failure is None:
                self._notice_dead_rank()  # the collective may fail before the reply reader sees the exit
            if self._failure is not None:
                raise RankFailedError(self._failure) from error
            raise

    def _notice_dead_rank(self, timeout_s: float = DEAD_RANK_WAIT_S) -> None:
        """Records the first rank whose process has exited (waiting up to timeout_s for one to)."""
        exited = multiprocessing.connection.wait([rank.sentinel for rank in self.ranks], timeout_s)
        for rank in self.ranks:
            if rank.sentinel in exited:
                self._on_rank_failure(rank, rank.exit_reason())
                return

    def shutdown(self) -> None:
        """Stops the other ranks, then leaves the group: aborted, not destroyed, since a destroy waits on
        peers that are gone (it hung after NCCL ranks exited). Runs once (again at exit: a no-op)."""
        if self._stopping:
            return
        atexit.unregister(self.shutdown)
        self._stopping = True
        if self.runner is not None:  # graphs that captured collectives go first, or leaving the group blocks
            self.runner.release_graphs()
        if self._failure is None:
            data = pickle.dumps((tp_worker.STOP, None))
            for rank in self.ranks:
                with contextlib.suppress(OSError):
                    rank.send(data)
        for rank in self.ranks:
            rank.finish(timeout=10)
        if self._placement is not None:  # the actors are gone: give the cluster its resources back
            self._placement.close()
        # this process may build another engine: it must not keep this one's rank (or its group). Leaving
        # an NCCL group whose collectives CUDA graphs captured can block, so it gets a few seconds aside.
        leaving = threading.Thread(target=_leave_group, name="fitserve-leave-group", daemon=True)
        leaving.start()
        leaving.join(timeout=LEAVE_GROUP_TIMEOUT_S)
        if leaving.is_alive():
            logger.warning(
                "leaving the tensor-parallel group did not finish in %.0f s", LEAVE_GROUP_TIMEOUT_S
            )
            forget_tensor_parallel()
        torch.set_num_threads(self._threads_before)


def _leave_group() -> None:
    abort_tensor_parallel()
    destroy_tensor_parallel()
