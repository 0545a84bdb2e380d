"""--distributed-executor-backend ray: ranks 1.. run in Ray actors, on this machine or others.

The executor (worker/tp_executor.py) is the same as the mp backend's; only where a rank runs differs.
Each rank other than the first runs tp_worker.run_rank in an actor holding one CPU (one GPU on CUDA). The
actors are placed with one placement group per pipeline stage, STRICT_PACK: a stage's tensor-parallel
ranks share a node (their all-reduces stay on NVLink), stages may sit on different nodes. Stage 0's group
is pinned to the engine's node, whose first bundle is rank 0's: the engine's own process, as with mp (on
CUDA an idle actor holds that GPU for it, so Ray gives it to no other rank; the engine runs on the GPU
that actor was given). On CUDA every actor sees its node's GPUs, as vLLM's Ray workers do, and runs on the
one Ray gave it.

A rank's commands and replies go over one TCP connection back to the engine's host (multiprocessing's
Listener and Client, with a random authkey), the same send_bytes/recv_bytes the mp backend's pipes have.
The process group's rendezvous is at the engine host's IP as Ray sees it. A watcher thread per rank waits
on the actor's run: when the actor dies, its reason (Ray's words) stops the engine through the same
RankFailedError path as a process that exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from fitserve.config import EngineConfig
from fitserve.distributed.ray_cluster import cluster_gpus, connect_ray, import_ray
from fitserve.worker import tp_worker

ray = import_ray()  # without Ray: an error naming the fix (pip install "fitserve[ray]")
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

logger = logging.getLogger("fitserve")

# How long the cluster may take to reserve the ranks' CPUs/GPUs before the start fails, naming them
# (seconds; the variable overrides it).
PLACEMENT_TIMEOUT_S = 300.0
PLACEMENT_TIMEOUT_ENV = "FITSERVE_RAY_PLACEMENT_TIMEOUT_S"
# How long an actor may take to start and connect back to the engine.
CONNECT_TIMEOUT_S = 600.0


class _RankActor:
    """The process of one rank (or, on bundle 0, the holder of rank 0's GPU)."""

    def gpu_ids(self) -> list[str]:
        return [str(each) for each in ray.get_gpu_ids()]

    def run(
        self,
        config: EngineConfig,
        rank: int,
        size: int,
        address: str,
        channel: tuple[str, int],
        authkey: bytes,
        on_gpu: bool,
    ) -> None:
        connection = Client(channel, authkey=authkey)
        connection.send_bytes(pickle.dumps(rank))
        # The actor sees its node's GPUs (NOSET_CUDA_VISIBLE_DEVICES, as vLLM's workers do: NCCL then finds
        # its peers on the node) and runs on the one Ray gave it. Its parent is the node's raylet, not the
        # engine; Ray ends the actor when the engine (its owner) is gone. The run ends instead of the
        # process (a process that exits by itself is an error to Ray); the engine then kills the actor.
        device_index = local_device_index(self.gpu_ids()[0]) if on_gpu else None
        try:
            tp_worker.run_rank(
                config,
                rank,
                size,
                address,
                connection,
                connection,
                os.getppid(),
                device_index=device_index,
                exit_process=_end_run,
            )
        except _RunEnded as ended:
            if ended.code != 0:
                raise RuntimeError(f"rank {rank} failed (its error went to the engine)") from None


class _RunEnded(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _end_run(code: int) -> None:
    raise _RunEnded(code)


def local_device_index(gpu_id: str) -> int:
    """The cuda index, in this process, of the GPU Ray names `gpu_id` (Ray's ids are the node's
    CUDA_VISIBLE_DEVICES entries, or the device numbers when it is unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return int(gpu_id)
    listed = [each.strip() for each in visible.split(",")]
    if gpu_id not in listed:
        raise RuntimeError(
            f"--distributed-executor-backend ray: Ray gave this rank GPU {gpu_id}, which this process does "
            f"not see (CUDA_VISIBLE_DEVICES={visible}): start the engine and `ray start` with the same "
            "CUDA_VISIBLE_DEVICES"
        )
    return listed.index(gpu_id)


_RemoteRankActor = ray.remote(_RankActor)


class RayPlacement:
    """The cluster's resources for a run's ranks: the placement groups, the channel the actors connect
    back to, and the rendezvous address; `start_rank` starts rank 1.. in an actor."""

    def __init__(self, config: EngineConfig, size: int) -> None:
        connect_ray()
        parallel = config.parallel
        self.on_gpu = config.device.torch_device.type == "cuda"
        self._check_cluster(size)
        self.node_ip = ray.util.get_node_ip_address()
        self._authkey = secrets.token_bytes(32)
        self._listener = Listener((self.node_ip, 0), authkey=self._authkey)
        self._connections: dict[int, queue.SimpleQueue[Connection]] = {
            r: queue.SimpleQueue() for r in range(size)
        }
        self._holder: Any = None
        self.groups: list[PlacementGroup] = []
        try:
            self._reserve(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
            # rank 0's device: the GPU Ray gave the holder of its bundle (None on the CPU, or cuda:rank)
            self.first_rank_device = self._hold_first_gpu() if self.on_gpu else None
        except BaseException:
            self.close()
            raise
        self.address = f"tcp://{self.node_ip}:{_free_port(self.node_ip)}"
        threading.Thread(target=self._accept, name="fitserve-ray-accept", daemon=True).start()
        logger.info(
            "Ray: %d ranks in %d placement group(s) (STRICT_PACK per stage), rendezvous at %s",
            size,
            len(self.groups),
            self.address,
        )

    # ---- placement --------------------------------------------------------------------------------
    def _check_cluster(self, size: int) -> None:
        if not self.on_gpu:
            return
        gpus = cluster_gpus(ray)
        if gpus < size:
            raise RuntimeError(
                f"--distributed-executor-backend ray: {size} ranks need {size} GPUs, the Ray cluster has "
                f"{gpus}: add nodes (`ray start --address=HEAD:6379` on each) or lower "
                "--tensor-parallel-size / --pipeline-parallel-size"
            )

    def _bundle(self) -> dict[str, float]:
        return {"CPU": 1.0, "GPU": 1.0} if self.on_gpu else {"CPU": 1.0}

    def _reserve(self, tensor_parallel_size: int, stages: int) -> None:
        """A placement group per stage in self.groups (close() gives back those a failed start made)."""
        for stage in range(stages):
            bundles = [self._bundle() for _ in range(tensor_parallel_size)]
            if stage == 0:  # rank 0 is the engine's process: stage 0 on the engine's node
                bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
            self.groups.append(placement_group(bundles, strategy="STRICT_PACK"))
        timeout = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, PLACEMENT_TIMEOUT_S))
        waiting = [group.ready() for group in self.groups]
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout)
        if len(ready) < len(waiting):
            per_rank = "1 GPU and 1 CPU" if self.on_gpu else "1 CPU"
            free = ray.available_resources()
            raise RuntimeError(
                f"--distributed-executor-backend ray: the Ray cluster did not reserve {stages} stage(s) of "
                f"{tensor_parallel_size} ranks ({per_rank} each, a stage's ranks on one node, stage 0 on "
                f"this one) in {timeout:g} s ({PLACEMENT_TIMEOUT_ENV}); {free.get('CPU', 0):g} CPUs and "
                f"{free.get('GPU', 0):g} GPUs are free in the cluster: add nodes or lower "
                "--tensor-parallel-size / --pipeline-parallel-size"
            )

    def _strategy(self, rank: int, tensor_parallel_size: int) -> PlacementGroupSchedulingStrategy:
        stage, index = divmod(rank, tensor_parallel_size)
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[stage], placement_group_bundle_index=index
        )

    def _actor(self, rank: int, tensor_parallel_size: int) -> Any:
        options: dict[str, Any] = {}
        if self.on_gpu:  # the actor sees the node's GPUs and picks its own (_RankActor.run)
            options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        return _RemoteRankActor.options(
            num_cpus=1,
            num_gpus=1 if self.on_gpu else 0,
            scheduling_strategy=self._strategy(rank, tensor_parallel_size),
            **options,
        ).remote()

    def _hold_first_gpu(self) -> int:
        """An idle actor takes rank 0's bundle's GPU; this process then runs rank 0 on that GPU."""
        tensor_parallel_size = self.groups[0].bundle_count
        self._holder = self._actor(0, tensor_parallel_size)
        return local_device_index(ray.get(self._holder.gpu_ids.remote(), timeout=CONNECT_TIMEOUT_S)[0])

    # ---- ranks ------------------------------------------------------------------------------------
    def start_rank(self, config: EngineConfig, rank: int, size: int, address: str) -> RayRank:
        return RayRank(self, config, rank, size, address)

    def _accept(self) -> None:
        """Hands each actor's connection to its rank (the first message names the rank)."""
        while True:
            try:
                connection = self._listener.accept()
                rank = pickle.loads(connection.recv_bytes())
            except (OSError, EOFError, pickle.UnpicklingError, ValueError):  # closed, or a bad peer
                if self._listener is None:
                    return
                continue
            if rank in self._connections:
                self._connections[rank].put(connection)
            else:
                connection.close()

    def close(self) -> None:
        """Stops accepting, ends the GPU holder and gives the placement groups back."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        if self._holder is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._holder)
            self._holder = None
        for group in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self.groups = []


class RayRank:
    """Another rank in a Ray actor, with the mp backend's _Rank interface (worker/tp_executor.py)."""

    def __init__(
        self, placement: RayPlacement, config: EngineConfig, rank: int, size: int, address: str
    ) -> None:
        from fitserve.worker.tp_executor import rank_label

        parallel = config.parallel
        self.rank = rank
        self.label = rank_label(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self._placement = placement
        self._incoming = placement._connections[rank]
        self._connection: Connection | None = None
        self.replies: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._reason: str | None = None
        self._exited = threading.Event()
        self._sentinel_read, self._sentinel_write = os.pipe()  # readable once the actor is gone
        self.actor = placement._actor(rank, parallel.tensor_parallel_size)
        channel = placement._listener.address
        self._run = self.actor.run.remote(
            config, rank, size, address, channel, placement._authkey, placement.on_gpu
        )
        threading.Thread(target=self._watch, name=f"fitserve-rank-{rank}-actor", daemon=True).start()

    @property
    def sentinel(self) -> int:
        return self._sentinel_read

    def _watch(self) -> None:
        try:
            ray.get(self._run)
            self._reason = "its Ray actor returned"
        except ray.exceptions.RayActorError as error:
            self._reason = _death_reason(error)
        except Exception as error:  # noqa: BLE001 - any other failure of the run is the rank's reason
            self._reason = f"its Ray actor failed: {type(error).__name__}: {str(error).splitlines()[0]}"
        self._exited.set()
        os.close(self._sentinel_write)

    def exit_reason(self) -> str:
        """Why the actor is gone, once Ray says so (waits up to 5 s)."""
        self._exited.wait(timeout=5)
        return self._reason or "its Ray actor closed its connection"

    def _connect(self) -> Connection | None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return self._incoming.get(timeout=0.1)
            except queue.Empty:
                if self._exited.is_set():
                    return None
        return None

    def read_replies(self, on_failure: Any) -> None:
        connection = self._connect()
        if connection is None:
            reason = (
                self.exit_reason()
                if self._exited.is_set()
                else f"its Ray actor did not connect back to {self._placement.node_ip} in "
                f"{CONNECT_TIMEOUT_S:.0f} s (is this host reachable from the actor's node?)"
            )
            on_failure(self, reason)
            return
        self._connection = connection
        from fitserve.worker.tp_executor import read_rank_replies

        read_rank_replies(self, connection, on_failure)

    def send(self, data: bytes) -> None:
        if self._connection is None:
            raise OSError(f"{self.label} has not connected")
        self._connection.send_bytes(data)

    def finish(self, timeout: float) -> None:
        """Waits up to `timeout` for the actor to end (after STOP), then kills it."""
        self._exited.wait(timeout=timeout)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.close()
        if self._exited.wait(timeout=5):  # the watcher closed its end: nothing reads the sentinel now
            os.close(self._sentinel_read)


def _death_reason(error: Exception) -> str:
    """Ray's reason an actor died, in a line: "its Ray actor (pid 123 on 10.0.0.2) died: it was killed by
    `ray.kill`"."""
    text = str(error)
    where = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(": ")
        if key in ("pid", "ip"):
            where[key] = value
    why = "the actor died"
    marker = "The actor is dead because "
    if marker in text:
        why = text.split(marker, 1)[1].split(". ", 1)[0].splitlines()[0].rstrip(".")
    detail = "Worker exit detail: "
    if detail in text:  # why the worker process went, as its node saw it
        why += f" ({text.split(detail, 1)[1].split('. ', 1)[0].splitlines()[0].rstrip('.')})"
    located = f" (pid {where.get('pid', '?')} on {where.get('ip', '?')})" if where else ""
    return f"its Ray actor{located} died: {why}"


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
