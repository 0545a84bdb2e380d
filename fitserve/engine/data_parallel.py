"""`--data-parallel-size N`: N engine replicas behind one server, each request sent to the least loaded.

Each replica is a whole engine (an AsyncEngine over an engine process) on its own GPUs: replica i sees
GPUs [i * per_replica, (i + 1) * per_replica) of the visible ones through CUDA_VISIBLE_DEVICES, and runs
its own tensor parallel there. `DataParallelEngine` has AsyncEngine's surface, so the server, its metrics
and its health route serve N replicas as they serve one:

- a request goes to the healthy replica with the fewest requests in flight (ties: the lowest index);
- /health is 200 while every replica runs (one that stopped takes the server to 503, as one engine's
  death does: restart it);
- the stats (/metrics, the stats line) are the replicas' summed (KV cache usage: over all their blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fitserve.engine.async_engine import AsyncEngine, EngineUnavailableError, StreamsRequests
from fitserve.engine.engine import EngineStats
from fitserve.engine.request_stream import RequestStream


def replica_visible_devices(num_replicas: int, gpus_per_replica: int, visible: Sequence[str]) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES: consecutive groups of `gpus_per_replica` of `visible` (the
    GPUs this process sees: its own CUDA_VISIBLE_DEVICES entries, or their indices); ValueError naming the
    numbers and the fix when there are too few."""
    needed = num_replicas * gpus_per_replica
    if needed > len(visible):
        raise ValueError(
            f"data_parallel_size={num_replicas} x {gpus_per_replica} GPU(s) per replica needs {needed} GPUs, "
            f"{len(visible)} are visible: lower --data-parallel-size or --tensor-parallel-size, or make more "
            "GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return [",".join(visible[i * gpus_per_replica : (i + 1) * gpus_per_replica]) for i in range(num_replicas)]


_NOT_SUMMED = ("kv_cache_usage", "block_size", "iteration_tokens_counts", "spec_accepted_per_pos")


def merge_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts summed, KV cache usage over all their blocks."""
    blocks = sum(s.num_kv_blocks for s in stats)
    usage = sum(s.kv_cache_usage * s.num_kv_blocks for s in stats) / blocks if blocks else 0.0
    counts = [s.iteration_tokens_counts for s in stats if s.iteration_tokens_counts]
    per_pos = [s.spec_accepted_per_pos for s in stats if s.spec_accepted_per_pos]
    summed = {
        field.name: sum(getattr(s, field.name) for s in stats)
        for field in dataclasses.fields(EngineStats)
        if field.name not in _NOT_SUMMED
    }
    return EngineStats(
        **summed,
        kv_cache_usage=usage,
        block_size=stats[0].block_size,
        iteration_tokens_counts=tuple(map(sum, zip(*counts))) if counts else (),
        spec_accepted_per_pos=tuple(map(sum, zip(*per_pos))) if per_pos else (),
    )


class DataParallelEngine(StreamsRequests):
    def __init__(self, replicas: Sequence[AsyncEngine]) -> None:
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        # alike on every replica (one config resolved per replica, on alike GPUs)
        self.engine = first.engine
        self.tokenizer = first.tokenizer
        self.config = first.config
        self.log_stats = first.log_stats
        # one list every replica notifies (the server appends its metrics and request log here)
        self.observers: list[Any] = []
        for replica in self.replicas:
            replica.observers = self.observers

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    @property
    def is_healthy(self) -> bool:
        return all(replica.is_healthy for replica in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    def default_sampling_params(self) -> Any:
        return self.replicas[0].default_sampling_params()

    def get_stats(self) -> EngineStats:
        return merge_stats([replica.get_stats() for replica in self.replicas])

    def pick(self) -> AsyncEngine:
        """The healthy replica with the fewest requests in flight."""
        healthy = [replica for replica in self.replicas if replica.is_healthy]
        if not healthy:
            raise EngineUnavailableError("every engine replica has stopped: restart the server")
        return min(healthy, key=lambda replica: replica.num_in_flight)

    async def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: Any
    ) -> RequestStream:
        if any(request_id in replica._streams for replica in self.replicas):  # noqa: SLF001 - ids are global
            raise ValueError(f"request id {request_id!r} is already running: use a unique id")
        return await self.pick().add_request(request_id, prompt, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            replica.abort(request_id)  # a no-op on the replicas that do not run it

    def begin_shutdown(self) -> None:
        for replica in self.replicas:
            replica.begin_shutdown()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for replica in self.replicas:
            await replica.shutdown(timeout_s)
