"""Which part of a checkpoint tensor a tensor-parallel rank holds.

A column-parallel layer splits its output rows: rank r of n holds rows [r * out/n, (r+1) * out/n) of
each shard (q, k, v or gate, up), so every rank's packed matrix is itself [q | k | v] or [gate | up].
Key/value heads are split the same way while there are at least as many as ranks; with fewer (8 KV heads
on 16 ranks, 1 on 2), each head is replicated on n / kv_heads consecutive ranks (rank r holds head
r // (n / kv_heads)), as vLLM does. A row-parallel layer splits its input columns the same way and sums
the ranks' outputs.
"""

from __future__ import annotations

import torch


def split_evenly(total: int, parts: int, what: str) -> int:
    """total / parts, or ValueError naming what does not divide."""
    if total % parts:
        raise ValueError(
            f"{what} ({total}) is not divisible by tensor_parallel_size={parts}: choose a "
            "--tensor-parallel-size that divides it"
        )
    return total // parts


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads one rank holds: num_kv_heads / size, or 1 (replicated) when there are fewer heads than
    ranks; ValueError when neither divides the other."""
    if num_kv_heads >= size:
        return split_evenly(num_kv_heads, size, "the number of KV heads")
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} is neither a divisor nor a multiple of the model's "
            f"{num_kv_heads} KV heads: choose one that is"
        )
    return 1


def first_kv_head(num_kv_heads: int, rank: int, size: int) -> int:
    """The first KV head rank `rank` holds (see kv_heads_per_rank)."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)


def rank_rows(tensor: torch.Tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """tensor's [start, start + size) along dim, or tensor itself when that is all of it."""
    if start == 0 and size == tensor.shape[dim]:
        return tensor
    if start + size > tensor.shape[dim]:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(tensor.shape)}, this rank reads [{start}, {start + size}) "
            f"along dim {dim}: the checkpoint does not match the model's config.json"
        )
    return tensor.narrow(dim, start, size)
