"""Decode-only steps of the CPU backend: one new token per sequence, a cache in the activations' dtype.

It computes what the general path in cpu_backend.py computes for such a step (write the new keys
and values at their slots, gather each sequence's blocks, one SDPA call in which a key/value head's
query heads are its rows), in fewer operations per layer, which is what a decode step on the CPU costs:
- everything that is the same for every layer is built once per step (`DecodeGather`): the rows to
  copy (key blocks, then value blocks: one index_select per layer), the views SDPA reads them through,
  the padding mask;
- a single sequence whose blocks follow one another in the cache (a lone stream's usual layout) is
  not gathered at all: SDPA reads its keys and values where they are, through strided views;
- the new keys and values are written with one index_copy_ (keys and values side by side).
The values SDPA sees, their layout and the call are those of the general path, so the result is the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DecodeGather:
    """Where a decode step's layers read each sequence's keys and values from; [batch, kv_heads,
    kv_len, head_dim] views, with `mask` [batch, 1, 1, kv_len] hiding the padding past each length.

    Either `rows` (int64 [2 * n]: each block's row in the cache seen as [2 * num_blocks, block elements],
    keys first) are copied into `gathered`, which `keys` and `values` view; or, for one sequence on
    consecutive blocks, `first_block` is where they start and the views are made on each layer's cache.
    """

    num_blocks: int
    block_shape: tuple[int, int, int]  # block_size, num_kv_heads, head_dim
    dtype: torch.dtype
    kv_len: int
    mask: torch.Tensor
    # int64 [2 * batch]: the new tokens' rows in the cache seen as [2 * slots, kv_heads, dim], keys first
    slot_rows: torch.Tensor
    first_block: int | None = None
    rows: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def fits(self, kv_cache: torch.Tensor) -> bool:
        _, num_blocks, *block_shape = kv_cache.shape
        return (
            num_blocks == self.num_blocks
            and tuple(block_shape) == self.block_shape
            and kv_cache.dtype == self.dtype
        )

    def keys_and_values(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.first_block is None:
            assert self.rows is not None and self.gathered is not None
            torch.index_select(kv_cache.view(2 * self.num_blocks, -1), 0, self.rows, out=self.gathered)
            assert self.keys is not None and self.values is not None
            return self.keys, self.values
        # [2, num_blocks, block, kv_heads, dim] is contiguous (checked on the step's first cache; the
        # write views every cache flat): the run of blocks is [kv_len, kv_heads, dim] for keys and,
        # num_blocks blocks further, for values.
        block_size, num_kv_heads, head_dim = self.block_shape
        size = (1, num_kv_heads, self.kv_len, head_dim)
        stride = (self.kv_len * num_kv_heads * head_dim, head_dim, num_kv_heads * head_dim, 1)
        start = kv_cache.storage_offset() + self.first_block * block_size * num_kv_heads * head_dim
        values_start = start + self.num_blocks * block_size * num_kv_heads * head_dim
        return kv_cache.as_strided(size, stride, start), kv_cache.as_strided(size, stride, values_start)


def plan_decode_gather(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    batch: int,
    kv_len: int,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    buffer_for: Callable[[int], torch.Tensor],
) -> DecodeGather:
    """The step's `DecodeGather` for caches shaped like `kv_cache`. slot_mapping: int64 [batch], each new
    token's slot; block_ids: int64 [batch * kv_len / block_size], each sequence's blocks in order;
    buffer_for(numel): a scratch tensor of the cache dtype."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    gather = DecodeGather(
        num_blocks=num_blocks,
        block_shape=(block_size, num_kv_heads, head_dim),
        dtype=kv_cache.dtype,
        kv_len=kv_len,
        mask=mask,
        slot_rows=torch.cat((slot_mapping, slot_mapping + num_blocks * block_size)),
    )
    first_block = _start_of_consecutive_run(block_ids) if batch == 1 else None
    if first_block is not None and kv_cache.is_contiguous():
        gather.first_block = first_block
        return gather
    num_rows = 2 * block_ids.numel()
    per_block = block_size * num_kv_heads * head_dim
    gathered = buffer_for(num_rows * per_block).view(num_rows, per_block)
    per_token = gathered.view(2, batch, kv_len, num_kv_heads, head_dim)
    gather.rows = torch.cat((block_ids, block_ids + num_blocks))
    gather.gathered = gathered
    gather.keys = per_token[0].transpose(1, 2)
    gather.values = per_token[1].transpose(1, 2)
    return gather


def _start_of_consecutive_run(block_ids: torch.Tensor) -> int | None:
    """block_ids[0] when the ids are block_ids[0], block_ids[0] + 1, ...; else None (and on a GPU, where
    reading them would wait for the device)."""
    if block_ids.device.type != "cpu":
        return None
    ids = block_ids.tolist()
    first = ids[0]
    return first if ids == list(range(first, first + len(ids))) else None


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    gather: DecodeGather,
    scale: float,
) -> torch.Tensor:
    """Writes k, v [batch, kv_heads, dim] at their slots, then q [batch, heads, dim] attends over each
    sequence's keys and values. Returns [batch, heads, dim]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, gather.slot_rows, torch.cat((k, v)))
    keys, values = gather.keys_and_values(kv_cache)
    batch, num_heads, _ = q.shape
    # [batch, kv_heads, heads_per_kv, head_dim]: a key/value head's query heads are its rows.
    rows = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=gather.mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)
