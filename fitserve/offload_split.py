"""--cpu-offload-gb: which decoder layers stay in CPU memory, and what the GPU still holds for them.

fitserve's engine (fitserve/models/cpu_offload.py) keeps whole decoder layers' weights in CPU memory, the
first layers first, until at least cpu_offload_gb GiB are there. Right before an offloaded layer runs,
its weights are copied into a GPU staging buffer the size of one layer, which every offloaded layer
shares. Only decoder layers are offloaded: the embeddings, the final norm and the LM head stay on the GPU.
So, per GPU: weights = all weights - offloaded + staging.

In CPU memory the offloaded weights are page-locked, in chunks from torch's pinned allocator, which rounds
every allocation up to a power of two. So the engine asks for powers of two only (`HostChunks`): one
chunk for all the layers still to place when that wastes less than a layer, else the largest chunk they
fill. Host RAM = offloaded + less than one layer per chunk, over a few chunks (Qwen3-0.6B's first 18
layers: 2 chunks, +0.7%; one layer alone can take up to twice its bytes, as any power of two can).

This file is that arithmetic, shared by the engine and the planner; it imports nothing device-specific.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

GiB = 1 << 30
HOST_ALIGN_BYTES = 256  # every flat buffer, and every parameter's view in one, starts at a multiple of this


@dataclass(frozen=True)
class OffloadSplit:
    num_layers: int  # the first `num_layers` decoder layers stay in CPU memory
    offloaded_bytes: int  # their weights
    staging_bytes: int  # the GPU buffer they are copied into before each runs: the largest of them
    # the page-locked CPU memory the engine allocates for them (`HostChunks`); not part of equality
    host_bytes: int = field(default=0, compare=False)

    @property
    def gpu_bytes_saved(self) -> int:
        return self.offloaded_bytes - self.staging_bytes


NO_OFFLOAD = OffloadSplit(0, 0, 0)


def first_layers_holding(layer_bytes: Sequence[int], wanted_bytes: float) -> OffloadSplit:
    """The fewest first layers whose weights reach `wanted_bytes`; every layer when they all do not."""
    offloaded = count = 0
    while offloaded < wanted_bytes and count < len(layer_bytes):
        offloaded += layer_bytes[count]
        count += 1
    if count == 0:
        return NO_OFFLOAD
    return OffloadSplit(count, offloaded, max(layer_bytes[:count]), pinned_host_bytes(layer_bytes[:count]))


def split_offload(layer_bytes: Sequence[int], cpu_offload_gb: float) -> OffloadSplit:
    """The engine's choice for `cpu_offload_gb` GiB over decoder layers of `layer_bytes` each.

    Raises ValueError naming the largest value that works when all the layers hold less than asked.
    """
    if not math.isfinite(cpu_offload_gb) or cpu_offload_gb < 0:
        raise ValueError(
            f"cpu_offload_gb={cpu_offload_gb} is not a size in GiB: set --cpu-offload-gb to 0 or more"
        )
    total = sum(layer_bytes)
    if cpu_offload_gb * GiB > total:
        raise ValueError(offload_too_large_message(cpu_offload_gb, total, len(layer_bytes)))
    return first_layers_holding(layer_bytes, cpu_offload_gb * GiB)


def max_offload_gib(total_layer_bytes: int) -> float:
    """The largest --cpu-offload-gb (2 decimals, rounded down) that the decoder layers hold."""
    return math.floor(total_layer_bytes / GiB * 100) / 100


def offload_too_large_message(cpu_offload_gb: float, total_layer_bytes: int, num_layers: int) -> str:
    return (
        f"cpu_offload_gb={cpu_offload_gb:g} is more than the {total_layer_bytes / GiB:.2f} GiB of weights in "
        f"the model's {num_layers} decoder layers, the only weights kept in CPU memory (the embeddings and "
        f"LM head stay on the GPU): set --cpu-offload-gb {max_offload_gib(total_layer_bytes):g} or less"
    )


def host_chunk_bytes(request_bytes: int, expected_bytes: int) -> int:
    """The size of the next chunk of page-locked memory, to hold `request_bytes` when `expected_bytes`
    (this request included) are still to be placed. A power of two, which torch's pinned allocator does
    not round up: one chunk for all of them when that wastes less than the request, else the largest that
    they fill (at least the request), more chunks following."""
    request_bytes = max(request_bytes, 1)
    expected_bytes = max(expected_bytes, request_bytes)
    whole = 1 << (expected_bytes - 1).bit_length()
    if whole - expected_bytes < request_bytes:
        return whole
    filled = 1 << (expected_bytes.bit_length() - 1)
    return max(1 << (request_bytes - 1).bit_length(), filled)


class HostChunks:
    """Where the offloaded layers' flat buffers go in page-locked memory, one request at a time: the
    engine's arithmetic (fitserve/models/cpu_offload.py allocates `sizes`), and the planner's."""

    def __init__(self, expected_bytes: int = 0) -> None:
        self.expected_bytes = expected_bytes  # still to be placed: sizes the next chunk
        self.sizes: list[int] = []  # of the chunks so far
        self._free = 0  # bytes left at the end of the last chunk

    def place(self, nbytes: int) -> tuple[int, int]:
        """(chunk index, byte offset) of a buffer of `nbytes`; it opens a new chunk when the last has no
        room for it (what the last one had left is lost)."""
        size = -(-nbytes // HOST_ALIGN_BYTES) * HOST_ALIGN_BYTES
        if size > self._free or not self.sizes:
            self.sizes.append(host_chunk_bytes(size, self.expected_bytes))
            self._free = self.sizes[-1]
        offset = self.sizes[-1] - self._free
        self._free -= size
        self.expected_bytes = max(0, self.expected_bytes - size)
        return len(self.sizes) - 1, offset

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def pinned_host_bytes(request_bytes: Sequence[int]) -> int:
    """The page-locked memory the engine allocates for flat buffers of `request_bytes`, in that order, all
    expected from the start (one per offloaded layer and dtype: the engine knows how many layers it
    offloads before it moves the first)."""
    aligned = [-(-n // HOST_ALIGN_BYTES) * HOST_ALIGN_BYTES for n in request_bytes]
    chunks = HostChunks(sum(aligned))
    for nbytes in aligned:
        chunks.place(nbytes)
    return chunks.total_bytes
