"""CpuAttentionBackend: the production attention backend on the CPU (the CUDA one is triton_backend.py).

Paged attention in plain PyTorch, with fitserve's C decode attention (cpu/c_kernels/decode_attention.c) for
a decode-only step over a float32 cache when it is built for this machine.

Per layer and step: the new keys/values are written into the cache at `slot_mapping`, each sequence's
context is gathered through its block table, and the queries attend with
`torch.nn.functional.scaled_dot_product_attention` (its kernels accumulate bf16/fp16 in float32).

Calls per step (the grouping is built once per step, `_StepPlan`, and reused by every layer):
- all sequences with short queries (<= BATCHED_QUERY_LEN_LIMIT: decode steps, short chunks) in one padded
  call. When they are all decodes, the query heads that share a key/value head become that head's query
  rows ([batch, kv_heads, heads_per_kv, head_dim]), so one broadcast mask serves them and no key/value is
  repeated;
- each sequence with a long query (a prefill chunk) alone, never padding the short ones to its length:
  causal SDPA without a mask when nothing is cached before it, otherwise query tiles with an offset mask,
  each tile reading only the keys it can see.

A decode-only step over a cache in the activations' dtype (the CPU's usual step) takes paged_decode.py,
the same computation in fewer operations per layer.

A layer with a sliding window (Gemma-4's sliding layers) passes `window`: while every context of the step
fits in it nothing changes; otherwise the step takes the general path with the window in its masks (query
position p sees keys p - window + 1 .. p; a long query's tiles gather only the keys their window reaches).
A KV-shared layer passes `write=False` and k = v = None: it attends over the cache an earlier layer of the
same step filled.

Invariant the caller keeps: the KV cache was allocated zeroed. Slots past a sequence's length (the rest
of its last block, and the padded block-table entries) are masked out, but masked values still meet a
zero probability in the matmul, so they must be finite.

A float8 cache (kernels/kv_format.py has the convention) is written through quantize_kv; its bytes are
copied as uint8, which every index op supports. It is read as the Triton kernels read it: the stored
values are converted to the query dtype as they are (exact: every e4m3/e5m2 value is a bf16, fp16 and
fp32 value), k_scale is folded into the softmax scale and v_scale multiplies the output. Rounding
stored * scale to bf16 instead would add a relative error of up to 2**-9 to every key and value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fitserve.kernels.kv_format import dequantize_kv, is_fp8_kv_cache, kv_bytes_view, write_kv_cache
from fitserve.layers.attention.metadata import AttentionMetadata
from fitserve.layers.attention.paged_decode import (
    DecodeGather,
    decode_attention,
    plan_decode_gather,
)
from fitserve.layers.cpu.c_kernels.decode_attention import BoundDecodeAttention
from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels

if TYPE_CHECKING:
    from fitserve.layers.attention.backend import QKNorm
    from fitserve.layers.rotary_embedding import StepRope

# A sequence whose query is at most this many tokens joins the padded batch; a longer one runs alone.
BATCHED_QUERY_LEN_LIMIT = 16
# Query rows per SDPA call for a long query over a cached prefix (bounds the mask to tile x context).
LONG_QUERY_TILE = 512


def group_sequences(query_lens: list[int]) -> list[list[int]]:
    """Sequence indices per attention call: all short queries together, each long query alone."""
    short = [i for i, n in enumerate(query_lens) if n <= BATCHED_QUERY_LEN_LIMIT]
    groups = [short] if short else []
    groups.extend([i] for i, n in enumerate(query_lens) if n > BATCHED_QUERY_LEN_LIMIT)
    return groups


@dataclass
class _GroupPlan:
    """One group's attention: `batch` sequences, queries padded to `query_len`, keys to `kv_len`."""

    batch: int
    query_len: int
    kv_len: int
    first_pos: torch.Tensor  # int64 [batch]: position of each sequence's first query token
    first_pos_host: int  # first_pos[0] when batch == 1, else -1
    block_ids: torch.Tensor  # int64 [batch * kv_len / block_size]: blocks to gather, sequence by sequence
    # Padded query slot -> row of q (padding repeats a sequence's last row), and which slots are real.
    # None when q already has this layout (the group is the whole batch, all queries the same length).
    padded_rows: torch.Tensor | None
    valid: torch.Tensor | None
    # Additive (0 / -inf) mask [batch, 1, query_len, kv_len] per (dtype, window), for short queries; built
    # once.
    masks: dict[tuple[torch.dtype, int | None], torch.Tensor] = field(default_factory=dict)

    @property
    def is_prefill_from_start(self) -> bool:
        return self.batch == 1 and self.query_len > BATCHED_QUERY_LEN_LIMIT and self.first_pos_host == 0

    def offset_mask(
        self, rows: slice, keys: int, dtype: torch.dtype, window: int | None = None, first_key: int = 0
    ) -> torch.Tensor:
        """Additive mask [batch, 1, len(rows), keys - first_key]: query row j (position first_pos + j)
        sees the keys at positions first_key .. keys - 1 that are <= its position and, with a window,
        newer than its position - window."""
        device = self.first_pos.device
        query_pos = self.first_pos[:, None] + torch.arange(rows.start, rows.stop, device=device)[None, :]
        key_pos = torch.arange(first_key, keys, device=device)[None, None, :]
        allowed = key_pos <= query_pos[:, :, None]
        if window is not None:
            allowed &= key_pos > query_pos[:, :, None] - window
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return mask[:, None]

    def short_query_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        mask = self.masks.get((dtype, window))
        if mask is None:
            mask = self.offset_mask(slice(0, self.query_len), self.kv_len, dtype, window)
            self.masks[(dtype, window)] = mask
        return mask


@dataclass
class _StepPlan:
    block_size: int
    groups: list[_GroupPlan]
    decode_gather: DecodeGather | None = None  # built by the first layer that takes the decode path
    # the C decode attention bound to this step (False: not usable), by the first layer that asks
    decode_kernel: BoundDecodeAttention | bool | None = None

    @property
    def is_decode_only(self) -> bool:
        """One group of one query token per sequence, in the batch's own order."""
        return len(self.groups) == 1 and self.groups[0].query_len == 1 and self.groups[0].padded_rows is None


def _plan_step(metadata: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
    query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    query_starts = [0]
    for n in query_lens[:-1]:
        query_starts.append(query_starts[-1] + n)
    plans = []
    for group in group_sequences(query_lens):
        group_query_lens = [query_lens[i] for i in group]
        query_len = max(group_query_lens)
        blocks_per_seq = -(-max(seq_lens[i] for i in group) // block_size)
        whole_batch = len(group) == metadata.num_seqs
        tables = (
            metadata.block_tables
            if whole_batch
            else metadata.block_tables[torch.tensor(group, device=device)]
        )
        first_pos_host = [seq_lens[i] - query_lens[i] for i in group]
        padded_rows = valid = None
        if not (whole_batch and len(set(group_query_lens)) == 1):
            offsets = torch.arange(query_len, device=device)
            starts = torch.tensor([query_starts[i] for i in group], device=device)
            lens = torch.tensor(group_query_lens, device=device)
            padded_rows = (starts[:, None] + torch.minimum(offsets[None, :], lens[:, None] - 1)).flatten()
            valid = (offsets[None, :] < lens[:, None]).flatten()
        plans.append(
            _GroupPlan(
                batch=len(group),
                query_len=query_len,
                kv_len=blocks_per_seq * block_size,
                first_pos=torch.tensor(first_pos_host, device=device),
                first_pos_host=first_pos_host[0] if len(group) == 1 else -1,
                block_ids=tables[:, :blocks_per_seq].reshape(-1).to(torch.int64),
                padded_rows=padded_rows,
                valid=valid,
            )
        )
    return _StepPlan(block_size, plans)


class CpuAttentionBackend:
    name = "cpu"
    supports_sliding_window = True  # forward(window=...) masks the keys older than the window
    supports_kv_sharing = True  # forward(write=False) reads another layer's cache, writing nothing

    def __init__(self) -> None:
        # Reused destination of the block gather, per (device, dtype, inference mode): saves an allocation
        # (and its page faults on the CPU) per layer. Only read inside one call, so layers can share it.
        self._gather_buffers: dict[tuple[torch.device, torch.dtype, bool], torch.Tensor] = {}
        # The plans of the step being run, one per metadata object (one per KV cache group): the object
        # it was built from (held, so its identity cannot be reused by a later step's object) and the plan.
        self._planned: list[tuple[AttentionMetadata, _StepPlan]] = []

    def fuses_rotary(self, head_dim: int, rope: StepRope) -> bool:
        return False  # the model rotates q and k (StepRope.rotate) before calling forward

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: StepRope | None = None,
        qk_norm: QKNorm | None = None,
        window: int | None = None,
        write: bool = True,
    ) -> torch.Tensor:
        """window: the layer's sliding window (keys older than it are masked). write False: k and v are
        None and nothing is written (a KV-shared layer reading the cache another layer filled)."""
        assert rope is None and qk_norm is None, "this backend does not rotate (fuses_rotary is False)"
        if window is not None and metadata.max_seq_len <= window:
            window = None  # every context fits in the window: it hides no key
        if window is not None or not write:
            return self._forward_general(q, k, v, kv_cache, metadata, scale, k_scale, v_scale, window, write)
        for planned in self._planned:
            if planned[0] is metadata and planned[1].decode_kernel:
                # the step's C decode attention is bound (by its first layer): straight to it
                out = planned[1].decode_kernel(q, k, v, kv_cache, scale)
                if out is not None:
                    return out
                break
        plan = self._step_plan(metadata, kv_cache.shape[2], q.device)
        if plan.is_decode_only and kv_cache.dtype == q.dtype:
            if plan.decode_kernel is None:
                plan.decode_kernel = self._bind_decode_kernel(q, k, v, kv_cache, metadata) or False
            if plan.decode_kernel:
                out = plan.decode_kernel(q, k, v, kv_cache, scale)
                if out is not None:
                    return out
            gather = self._decode_gather(plan, kv_cache, metadata.slot_mapping)
            return decode_attention(q, k, v, kv_cache, gather, scale)
        return self._forward_general(q, k, v, kv_cache, metadata, scale, k_scale, v_scale, None, True, plan)

    def _forward_general(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float,
        v_scale: float,
        window: int | None,
        write: bool,
        plan: _StepPlan | None = None,
    ) -> torch.Tensor:
        """Writes k and v (when `write`), then attends group by group (_attend), masking by `window`."""
        plan = plan or self._step_plan(metadata, kv_cache.shape[2], q.device)
        if write:
            assert k is not None and v is not None
            write_kv_cache(kv_cache, k, v, metadata.slot_mapping, k_scale, v_scale)
        fp8 = is_fp8_kv_cache(kv_cache.dtype)
        if fp8:
            scale = scale * k_scale  # q . (stored * k_scale) * scale, with the stored keys read exactly
        if len(plan.groups) == 1 and plan.groups[0].padded_rows is None:
            out = self._attend(q, kv_cache, plan.groups[0], scale, window)
        else:
            out = torch.empty_like(q)
            for group in plan.groups:
                assert group.padded_rows is not None and group.valid is not None
                result = self._attend(q.index_select(0, group.padded_rows), kv_cache, group, scale, window)
                out.index_copy_(0, group.padded_rows[group.valid], result[group.valid])
        if fp8 and v_scale != 1.0:
            out = out * v_scale  # softmax(...) @ (stored * v_scale) = (softmax(...) @ stored) * v_scale
        return out

    @staticmethod
    def _bind_decode_kernel(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> BoundDecodeAttention | None:
        """fitserve's C decode attention for this step, when it is built here and takes these tensors (a
        float32 CPU cache): one call per layer instead of paged_decode.py's ~10 torch operations. Bound
        once per step (every layer's cache and q share their shapes) by the first layer."""
        if q.is_cuda:
            return None
        kernels = load_cpu_kernels()
        if kernels is None or not kernels.decode_attention.supports(q, k, v, kv_cache):
            return None
        return kernels.decode_attention.bind(
            metadata.slot_mapping, metadata.block_tables, metadata.seq_lens, q.shape, kv_cache.shape
        )

    def _decode_gather(
        self, plan: _StepPlan, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> DecodeGather:
        gather = plan.decode_gather
        if gather is None or not gather.fits(kv_cache):
            group = plan.groups[0]
            gather = plan_decode_gather(
                kv_cache,
                slot_mapping,
                group.batch,
                group.kv_len,
                group.block_ids,
                group.short_query_mask(kv_cache.dtype),
                lambda numel: self._gather_buffer(kv_cache.device, kv_cache.dtype, numel),
            )
            plan.decode_gather = gather
        return gather

    def _step_plan(self, metadata: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
        for planned_for, plan in self._planned:
            if planned_for is metadata and plan.block_size == block_size:
                return plan
        plan = _plan_step(metadata, block_size, device)
        # a step has one metadata object per KV cache group (a few); an older step's are dropped
        stale = any(old.query_lens_cpu is not metadata.query_lens_cpu for old, _ in self._planned)
        if stale or len(self._planned) >= 8:
            self._planned = []
        self._planned.append((metadata, plan))
        return plan

    def _attend(
        self,
        queries: torch.Tensor,
        kv_cache: torch.Tensor,
        group: _GroupPlan,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """queries [batch * query_len, heads, head_dim] in padded layout -> the same shape, attended; with
        a window, each query sees only the last `window` positions up to its own."""
        # [batch, kv_heads, kv_len, head_dim] each
        keys, values = self._gather(kv_cache, group, queries.dtype)
        batch, query_len, kv_len = group.batch, group.query_len, group.kv_len
        num_heads, head_dim = queries.shape[1:]
        num_kv_heads = keys.shape[1]
        if query_len == 1:
            # [batch, kv_heads, heads_per_kv, head_dim]: a key/value head's query heads are its rows.
            rows = queries.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
            # [batch, 1, 1, kv_len] broadcasts over rows
            mask = group.short_query_mask(queries.dtype, window)
            out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
            return out.reshape(batch, num_heads, head_dim)
        rows = queries.reshape(batch, query_len, num_heads, head_dim).transpose(1, 2)
        if group.is_prefill_from_start and (window is None or query_len <= window):
            out = F.scaled_dot_product_attention(
                rows, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        elif query_len <= BATCHED_QUERY_LEN_LIMIT:
            mask = group.short_query_mask(queries.dtype, window)
            out = F.scaled_dot_product_attention(
                rows, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            tiles = []
            for start in range(0, query_len, LONG_QUERY_TILE):
                tile = slice(start, min(start + LONG_QUERY_TILE, query_len))
                visible = min(kv_len, group.first_pos_host + tile.stop)  # keys up to the tile's last position
                # with a window, none before the one the tile's first query sees
                first = 0 if window is None else max(0, group.first_pos_host + tile.start - window + 1)
                mask = group.offset_mask(tile, visible, queries.dtype, window, first)
                tiles.append(
                    F.scaled_dot_product_attention(
                        rows[:, :, tile],
                        keys[:, :, first:visible],
                        values[:, :, first:visible],
                        attn_mask=mask,
                        scale=scale,
                        enable_gqa=True,
                    )
                )
            out = torch.cat(tiles, dim=2)
        return out.transpose(1, 2).reshape(batch * query_len, num_heads, head_dim)

    def _gather(
        self, kv_cache: torch.Tensor, group: _GroupPlan, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each sequence through its blocks: [batch, kv_heads, kv_len, head_dim] views.

        A float8 cache's stored values are converted to `dtype` unscaled (forward applies the scales)."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        per_block = block_size * num_kv_heads * head_dim
        num_gathered = group.block_ids.numel()
        source = kv_bytes_view(kv_cache)
        buffer = self._gather_buffer(kv_cache.device, source.dtype, 2 * num_gathered * per_block)
        buffer = buffer.view(2, num_gathered, per_block)
        gathered = []
        for kind in (0, 1):
            # Per kind along dim 0: the contiguous case that index_select spreads across threads.
            torch.index_select(source[kind].view(num_blocks, per_block), 0, group.block_ids, out=buffer[kind])
            stored = buffer[kind].view(kv_cache.dtype)
            per_token = stored.view(group.batch, group.kv_len, num_kv_heads, head_dim)
            gathered.append(dequantize_kv(per_token, dtype, 1.0).transpose(1, 2))
        return gathered[0], gathered[1]

    def _gather_buffer(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        # Keyed by inference mode too: a buffer made under inference_mode() cannot be written outside it.
        key = (device, dtype, torch.is_inference_mode_enabled())
        buffer = self._gather_buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._gather_buffers[key] = buffer
        return buffer[:numel]
