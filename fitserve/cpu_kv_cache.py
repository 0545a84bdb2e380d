"""The size of the KV cache on the CPU: one rule, used by the planner (`fitserve plan`, auto-fit) and by
the engine (worker/platforms.py), so `fitserve serve` and `LLM()` get the same pool.

--cpu-kv-cache-space GIB sets it. Left unset (None), it is sized to the requests it must hold:

    KV for FULL_LENGTH_REQUESTS (2) requests of max_model_len, and at least a block for each of
    max_num_seqs requests (every running request holds one, so fewer blocks cap the batch below it),
    at most RAM_FRACTION (half) of the RAM available once the weights are loaded,
    never below one request of max_model_len plus one step's max_num_batched_tokens.

Two full-length requests is the point where auto-fit keeps the model's own max_model_len
(planner/fit.py, FULL_LENGTH_REQUESTS): one long request never stalls every other, and short requests
share the same blocks (16,384 tokens are 32 requests of 512). A larger pool does not make a CPU decode
faster (its steps are compute-bound); it only costs RAM and the seconds to zero it at startup. The other
half of the available RAM is left to the step's activations (the sampler's float32 logits of up to
max_num_seqs rows), the page cache the weights are read through, and other processes.

With tensor parallel on the CPU (--tensor-parallel-size N: N processes with gloo on this host), the
size is per rank: each rank holds 1/N of the KV heads (so a block takes 1/N of the bytes) and may take
1/N of the cap, RAM_FRACTION of the RAM available once every rank's weights are loaded. The requests it
holds are the same on every rank; --cpu-kv-cache-space is each rank's, as vLLM's VLLM_CPU_KVCACHE_SPACE.

Every size is whole blocks of block_size tokens, the reserved null block included, as the engine
allocates them. This module imports only the standard library (fitserve.config for type checking): the
planner and the worker both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitserve.config import EngineConfig

GiB = 1 << 30
# Requests of max_model_len the automatic pool holds (see above); auto-fit keeps the model's own
# max_model_len when the KV cache holds this many (planner/fit.py).
FULL_LENGTH_REQUESTS = 2
# The automatic pool takes at most this fraction of the RAM available once the weights are loaded.
RAM_FRACTION = 0.5
FLAG = "--cpu-kv-cache-space"


@dataclass(frozen=True)
class CpuKvCacheSize:
    """What the KV pool on the CPU is, and why."""

    num_blocks: int  # allocated, the reserved null block included
    block_bytes: int
    block_size: int
    max_model_len: int
    step_tokens: int  # one step's max_num_batched_tokens, rounded up to whole blocks
    max_num_seqs: int
    explicit: bool  # --cpu-kv-cache-space was given
    cap_blocks: int | None = None  # RAM_FRACTION of the RAM available; None: unknown, or explicit
    available_bytes: int | None = None  # the RAM available (once the weights are loaded)
    ranks: int = 1  # tensor-parallel ranks on this host, sharing the RAM available: the size is one's

    @property
    def available_text(self) -> str:
        """The RAM the cap is a fraction of, as the reasons say it."""
        available = f"{(self.available_bytes or 0) / GiB:.1f} GiB available"
        return available if self.ranks == 1 else f"{available} split between {self.ranks} ranks"

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def gib(self) -> float:
        return self.bytes / GiB

    @property
    def tokens(self) -> int:
        """Tokens requests can use: every block but the null block."""
        return max(0, self.num_blocks - 1) * self.block_size

    @property
    def request_blocks(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def floor_blocks(self) -> int:
        """One request of max_model_len plus one step's tokens, and the null block."""
        return self.request_blocks + self.step_tokens // self.block_size + 1

    @property
    def wanted_blocks(self) -> int:
        """The automatic size before the RAM cap."""
        return max(self._full_length_blocks, self.floor_blocks, self._batch_blocks)

    @property
    def _full_length_blocks(self) -> int:
        return FULL_LENGTH_REQUESTS * self.request_blocks + 1

    @property
    def _batch_blocks(self) -> int:
        """A block for each of max_num_seqs requests, and the null block."""
        return self.max_num_seqs + 1

    @property
    def capped(self) -> bool:
        """The RAM cap made the automatic pool smaller than it wanted."""
        return not self.explicit and self.num_blocks < self.wanted_blocks

    @property
    def requests(self) -> float:
        """How many requests of max_model_len the pool holds."""
        return max(0, self.num_blocks - 1) / self.request_blocks

    @property
    def reason(self) -> str:
        """Why the pool is this size, in one phrase (the log line's parenthesis)."""
        per_token = f"{self.block_bytes / self.block_size / 1024:g} KiB a token"
        length = f"max_model_len {self.max_model_len}"
        if self.explicit:
            per_rank = " per rank" if self.ranks > 1 else ""
            return (
                f"set by you{per_rank}: {self.tokens:,} tokens, {self.requests:.1f}x {length} at {per_token}"
            )
        available = self.available_text
        least = f"one request of {length} plus a step's {self.step_tokens:,} tokens"
        if self.capped and self.num_blocks == self.floor_blocks:
            head = f"{least} at {per_token}, the least it runs with, over {RAM_FRACTION:.0%} of {available}"
        elif self.capped:
            head = (
                f"{RAM_FRACTION:.0%} of {available} holds {self.requests:.1f} requests of {length} "
                f"at {per_token}, not {FULL_LENGTH_REQUESTS}"
            )
        else:
            if self.wanted_blocks == self._full_length_blocks:
                wanted = f"{FULL_LENGTH_REQUESTS} requests of {length}"
            elif self.wanted_blocks == self.floor_blocks:
                wanted = least
            else:
                wanted = f"a {self.block_size}-token block for each of max_num_seqs {self.max_num_seqs}"
            within = "the RAM available is unknown" if self.available_bytes is None else f"within {available}"
            head = f"{wanted} at {per_token}, {within}"
        return f"auto-fit: {head}; {FLAG} GIB sets it"

    def log_line(self) -> str:
        per_rank = f" per rank ({self.ranks} ranks)" if self.ranks > 1 else ""
        return f"cpu_kv_cache_space = {self.gib:.2f} GiB{per_rank} ({self.reason})"


def cpu_kv_cache_size(
    space_gib: float | None,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    kv_bytes_per_token: int,
    available_bytes: int | None,
    ranks: int = 1,
) -> CpuKvCacheSize:
    """The pool of one rank for --cpu-kv-cache-space `space_gib` (None: the automatic rule above).

    `available_bytes`: the host's RAM available once the weights (of every rank) are loaded (the engine
    reads it after loading them; the planner subtracts its weights from what it reads before), or None when
    unknown. `ranks`: the tensor-parallel ranks sharing it; `kv_bytes_per_token` is one rank's.
    """
    block_bytes = kv_bytes_per_token * block_size
    step_tokens = math.ceil(max_num_batched_tokens / block_size) * block_size
    size = CpuKvCacheSize(
        0,
        block_bytes,
        block_size,
        max_model_len,
        step_tokens,
        max_num_seqs,
        space_gib is not None,
        None,
        available_bytes,
        max(1, ranks),
    )
    if space_gib is not None:
        return replace(size, num_blocks=int(space_gib * GiB // block_bytes))
    if available_bytes is None:
        return replace(size, num_blocks=size.wanted_blocks)
    cap = int(max(0, available_bytes) * RAM_FRACTION) // size.ranks // block_bytes
    blocks = max(size.floor_blocks, min(size.wanted_blocks, cap))
    return replace(size, num_blocks=blocks, cap_blocks=cap)


def engine_cpu_kv_cache_size(config: EngineConfig, available_bytes: int | None) -> CpuKvCacheSize:
    """`cpu_kv_cache_size` for a resolved EngineConfig (fitserve/config.py): the engine's pool."""
    model, cache = config.model, config.cache
    return cpu_kv_cache_size(
        cache.cpu_kv_cache_space_gib,
        max_model_len=model.max_model_len,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        block_size=cache.block_size,
        kv_bytes_per_token=config.kv_bytes_per_token,
        available_bytes=available_bytes,
        ranks=config.parallel.tensor_parallel_size,
    )


def available_ram_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of /proc/meminfo in bytes (MemFree on kernels without it); None where unreadable."""
    try:
        lines = Path(meminfo).read_text().splitlines()
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in ("MemAvailable", "MemFree") and parts and parts[0].isdigit():
            found[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return found.get("MemAvailable", found.get("MemFree"))


def check_cpu_kv_cache_space(space_gib: float | None) -> None:
    """Refuses an explicit size that is not a finite number of GiB above 0 (None, auto, is fine)."""
    if space_gib is None:
        return
    fix = f"set {FLAG} to a size in GiB such as 1, or leave it unset to size it to max_model_len"
    if not space_gib > 0:  # also NaN
        raise ValueError(f"cpu_kv_cache_space={space_gib} GiB is not above 0: {fix}")
    if math.isinf(space_gib):
        raise ValueError(f"cpu_kv_cache_space={space_gib} GiB is not a finite size: {fix}")


def check_fits_in_ram(space_gib: float | None, available_bytes: int | None, ranks: int = 1) -> None:
    """Refuses an explicit size (each of `ranks` ranks allocating it) larger than the RAM available
    (allocating it would swap or be killed)."""
    ranks = max(1, ranks)
    if space_gib is None or available_bytes is None or space_gib * GiB * ranks <= available_bytes:
        return
    largest = math.floor(available_bytes * RAM_FRACTION / ranks / GiB * 100) / 100
    smaller = f"set {FLAG} {largest:g} or less" if largest >= 0.01 else "free some RAM"
    each = f" ({ranks} ranks x {space_gib:g} GiB)" if ranks > 1 else ""
    raise ValueError(
        f"cpu_kv_cache_space={space_gib:g} GiB{each} is more than the {available_bytes / GiB:.2f} GiB of RAM "
        f"available: {smaller}, or leave it unset to size it to max_model_len"
    )
