"""Paged attention for decode: one query token per sequence, split-K over the context.

Each program takes one (sequence, KV head, context partition) and all the query heads that share
that KV head (GQA), so every key and value is read from HBM once. When the batch alone fills the
GPU there is one partition and the program writes the output directly (on WHOLE_CONTEXT_CONFIG's wider
tiles while that is at most two programs per SM: choose_config); otherwise each sequence's
context is cut into up to `num_partitions` pieces (flash-decoding), each piece stores its (max, sum,
output) triple, and a second kernel merges them, one program per (sequence, query head).

CUDA-graph safety: seq_lens and block_tables are read on the device only, and the grid depends only
on (batch size, num_kv_heads, block_tables.shape[1], the window). Each sequence's partition size is
derived on the device from its own seq_len, so short contexts still spread over the partitions.

A sliding window (Gemma-4's sliding layers; `window`): the token at position seq_len - 1 sees the keys at
seq_len - window .. seq_len - 1. The partitions then split only that span (from its first TILE_N-aligned
key), so a 100k-token context with a 1,024 window reads ~1k keys; the keys before the window are never
loaded (their block-table entries may be the null block 0, whose memory another request reuses).
Without a window (HAS_WINDOW False) the kernels compile to the code they had before windows existed.

A float8 cache: keys and values are converted to the query dtype (exact for e4m3 and e5m2); k_scale
is folded into the score scale and v_scale multiplies the output, both runtime float arguments. Below
compute capability 8.9 an e4m3 cache comes as its bytes (uint8), decoded by kernels/fp8_bits.py.

Reference: fitserve.kernels.reference.paged_attention_reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.attention_inputs import check_attention_inputs, kv_cache_for_kernels, kv_cache_scales
from fitserve.kernels.capability import SHARED_MEMORY_PER_BLOCK, kernel_capability, shared_memory_per_block
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.fp8_bits import stored_values
from fitserve.kernels.grid_math import cdiv, next_power_of_2

MAX_PARTITIONS = 64
SMALL_PARTITION_BLOCK = 8


@dataclass(frozen=True)
class DecodeLaunchConfig:
    tile_tokens: int = 64  # keys per inner-loop step; a power of two >= 16
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_DECODE_CONFIG = DecodeLaunchConfig()
# When the batch alone fills the GPU with at most two programs per SM (one partition: each program
# streams a whole context; the 8B shape's batches of 17 to 33), 128-token tiles with a deeper pipeline.
# A program then takes 140 KB of shared memory (Triton 3.6), so one fits an SM and the rest queue: an SM
# done with a short context takes the next one. With the default tile (39 KB) every program is resident
# from the start, two per SM, and an SM given two short contexts idles while those given the longest
# read on alone. Timings: docs/performance.md, section "Decode attention when the batch fills the GPU".
WHOLE_CONTEXT_CONFIG = DecodeLaunchConfig(tile_tokens=128, num_warps=4, num_stages=5)
WHOLE_CONTEXT_MAX_PROGRAMS_PER_SM = 2
# Where a block may not have that much (sm_86 / sm_89: 99 KB, sm_75: 64 KB, sm_70: 96 KB; sm_75 asks 72 KB
# for it as it pipelines without cp.async) the default config runs instead (kernels/variants.py checks it).
WHOLE_CONTEXT_MIN_SHARED = 144 * 1024
# A float8 cache (a byte an element) takes WHOLE_CONTEXT_CONFIG at any batch with one partition on Hopper
# (a block's 227 KB of shared memory tells it): its tiles hold half the bytes (75 KB and 146 registers a
# program there), and at 4 to 15 programs an SM the default's 64-key tiles leave it latency-bound (H200,
# one layer: Qwen3-0.6B shape batch 64 81.7 -> 62.7 us, batch 256 210.9 -> 184.0 us; equal workload +6.7%;
# benchmarks/results/h200_e4m3_kv_bytes.json), where a 16-bit cache keeps the default. Not below: sm_80
# compiles that variant to 255 registers (two programs an SM), unmeasured.
FLOAT8_ANY_BATCH_MIN_SHARED = 200 * 1024
# Heads wider than 128 (Gemma-4's 256 and 512; WHOLE_CONTEXT_CONFIG's 128-key tiles would not fit) keep
# about the default's bytes per tile: 32 keys x 256 and 16 keys x 512 (key and value tiles of 16 KB each),
# three stages. Gemma-4's full layers run 8 query heads per KV head over 512 dims: 8 warps hold the
# [16, 512] float32 accumulator in 32 registers a thread. ptxas -v for sm_90a, window variant: 154 and 118
# registers, 41 and 48 KB of shared memory, no spills.
HEAD_256_DECODE_CONFIG = DecodeLaunchConfig(tile_tokens=32, num_warps=4, num_stages=3)
WIDE_HEAD_DECODE_CONFIG = DecodeLaunchConfig(tile_tokens=16, num_warps=8, num_stages=3)


@triton.jit
def _partition_size(seq_len, num_partitions, TILE_N: tl.constexpr):
    """Tokens per partition for this sequence: a multiple of TILE_N, at least TILE_N."""
    per_partition = tl.cdiv(seq_len, num_partitions)
    per_partition = tl.cdiv(per_partition, TILE_N) * TILE_N
    return tl.maximum(per_partition, TILE_N)


@triton.jit
def _window_span_start(seq_len, window, TILE_N: tl.constexpr):
    """With a window, the first key the partitions cover: the TILE_N-aligned start of the tile holding
    the oldest key the window reaches (seq_len - window)."""
    return tl.maximum(seq_len - window, 0) // TILE_N * TILE_N


# Values that change with the batch size are not specialized on (Triton would compile one variant per
# divisibility class): each compile costs ~0.5 s at startup, and the block-table stride varies per step.
@host_launched
@triton.jit(do_not_specialize=["num_partitions", "stride_bt_seq", "window"])
def _decode_partition_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale_log2,
    v_scale,
    num_partitions,
    window,
    head_dim,
    stride_q_tok,
    stride_q_head,
    stride_out_tok,
    stride_out_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WRITE_DIRECT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    # Grid (KV head, sequence, partition): a sequence's KV heads are neighbouring programs, which run at
    # the same time and together read whole token rows of a cache block (docs/performance.md, section
    # "Decode attention: grid order and the fused merge").
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    num_kv_heads = tl.num_programs(0)
    partition = tl.program_id(2)
    num_q_heads = num_kv_heads * QUERIES_PER_KV

    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_WINDOW:
        span_start = _window_span_start(seq_len, window, TILE_N)
        part_size = _partition_size(seq_len - span_start, num_partitions, TILE_N)
        start = span_start + partition * part_size
    else:
        part_size = _partition_size(seq_len, num_partitions, TILE_N)
        start = partition * part_size
    group = tl.arange(0, BLOCK_G)
    heads = kv_head * QUERIES_PER_KV + group
    group_mask = group < QUERIES_PER_KV
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    seq64 = seq.to(tl.int64)
    out_ptrs = out_ptr + seq64 * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :]
    out_mask = group_mask[:, None] & dim_mask[None, :]
    if not WRITE_DIRECT and start >= seq_len:  # the merge skips partitions past the context
        return
    end = tl.minimum(start + part_size, seq_len)

    q = tl.load(
        q_ptr + seq64 * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv
    block_row = block_tables_ptr + seq64 * stride_bt_seq
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        token_mask = tokens < end
        if HAS_WINDOW:  # the first tile may start before the window: those keys are not loaded
            token_mask = token_mask & (tokens >= seq_len - window)
        block = tl.load(block_row + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
        rows = block * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_slot
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = stored_values(tl.load(k_base + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0), q.dtype)
        v = stored_values(tl.load(v_base + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0), q.dtype)
        scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if WRITE_DIRECT:
        # seq_len 0 (a padded batch row) leaves l_i at 0: write zeros, not NaN
        out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial buffers: [num_seqs, num_q_heads, num_partitions] and [..., BLOCK_D], contiguous
        first_index = (seq64 * num_q_heads + heads) * num_partitions
        index = first_index + partition
        tl.store(part_max_ptr + index, m_i, mask=group_mask)
        tl.store(part_sum_ptr + index, l_i, mask=group_mask)
        tl.store(
            part_out_ptr + index[:, None] * BLOCK_D + dims[None, :],
            acc * (v_scale / l_i)[:, None],
            mask=group_mask[:, None],
        )


@host_launched
@triton.jit(do_not_specialize=["num_partitions", "window"])
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    num_partitions,
    window,
    head_dim,
    stride_out_tok,
    stride_out_head,
    BLOCK_D: tl.constexpr,
    PARTITION_BLOCK: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    # The context length is a step input, so it and the number of partitions it used are known
    # before the wait. Only those partitions are loaded: a 1,536-token context in a 4,096-token block
    # table uses 24 of 64, and the rest (stale or uninitialised, NaN included) stay masked out.
    seq_len = tl.load(seq_lens_ptr + seq, cache_modifier=".cg")
    span = seq_len
    if HAS_WINDOW:
        span = seq_len - _window_span_start(seq_len, window, TILE_N)
    num_used = tl.cdiv(span, _partition_size(span, num_partitions, TILE_N))
    wait_for_previous_kernel(USE_PDL)
    parts = tl.arange(0, PARTITION_BLOCK)
    used = parts < num_used
    base = (seq.to(tl.int64) * num_q_heads + head) * num_partitions
    dims = tl.arange(0, BLOCK_D)
    m = tl.load(part_max_ptr + base + parts, mask=used, other=float("-inf"))
    s = tl.load(part_sum_ptr + base + parts, mask=used, other=0.0)
    partial = tl.load(
        part_out_ptr + (base + parts)[:, None] * BLOCK_D + dims[None, :], mask=used[:, None], other=0.0
    )
    m_max = tl.max(m, axis=0)
    weights = tl.where(used, s * tl.exp2(m - m_max), 0.0)  # a padded row (no partition used) gets 0
    total = tl.sum(weights, axis=0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_out_tok + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_partitions(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    sm_count: int,
    tile_tokens: int,
    window: int | None = None,
) -> int:
    """Partitions per sequence: 1 when batch x KV heads already covers every SM, else ~4 programs per SM,
    no more than the tiles of the span a sequence reads (its context, or with a window the window's keys
    from their first tile on).

    A function of shapes only (never of seq_lens' values), so the grid is fixed for a CUDA graph.
    """
    programs = num_seqs * num_kv_heads
    if programs >= sm_count:
        return 1
    span = max_context_len if window is None else min(max_context_len, window + tile_tokens - 1)
    wanted = cdiv(4 * sm_count, programs)
    useful = max(1, cdiv(span, tile_tokens))
    return max(1, min(wanted, useful, MAX_PARTITIONS))


def choose_config(
    num_seqs: int,
    num_kv_heads: int,
    num_partitions: int,
    sm_count: int,
    head_dim: int = 128,
    shared_memory: int = SHARED_MEMORY_PER_BLOCK[(9, 0)],
    kv_element_bytes: int = 2,
) -> DecodeLaunchConfig:
    """Heads of up to 128: WHOLE_CONTEXT_CONFIG for one partition of at most
    WHOLE_CONTEXT_MAX_PROGRAMS_PER_SM programs per SM where a block may have WHOLE_CONTEXT_MIN_SHARED
    bytes of shared memory (`shared_memory`: the GPU's, kernels/capability.py), and of any number over a
    float8 cache (`kv_element_bytes` 1) where it may have FLOAT8_ANY_BATCH_MIN_SHARED; else
    DEFAULT_DECODE_CONFIG. Wider heads: HEAD_256_DECODE_CONFIG up to 256, WIDE_HEAD_DECODE_CONFIG above.
    Shapes only, so a CUDA graph's launch is fixed."""
    block_d = next_power_of_2(head_dim)
    if block_d > 256:
        return WIDE_HEAD_DECODE_CONFIG
    if block_d > 128:
        return HEAD_256_DECODE_CONFIG
    programs = num_seqs * num_kv_heads
    whole_fits = shared_memory >= WHOLE_CONTEXT_MIN_SHARED
    few_programs = programs <= WHOLE_CONTEXT_MAX_PROGRAMS_PER_SM * sm_count
    float8_any_batch = kv_element_bytes == 1 and shared_memory >= FLOAT8_ANY_BATCH_MIN_SHARED
    if whole_fits and num_partitions == 1 and (few_programs or float8_any_batch):
        return WHOLE_CONTEXT_CONFIG
    return DEFAULT_DECODE_CONFIG


def split_tile_tokens(head_dim: int) -> int:
    """The tile the partition count is chosen for, before the config is: that of choose_config's split-K
    config (num_partitions > 1) for this head dim (the default's 64 up to 128, as before wide heads)."""
    return choose_config(1, 1, 2, 1, head_dim).tile_tokens


def partition_block_size(num_partitions: int) -> int:
    """The merge's vector width: two sizes only (8, or MAX_PARTITIONS), so the batch sizes of CUDA graph
    capture compile two variants of the kernels instead of one per power of two."""
    return SMALL_PARTITION_BLOCK if num_partitions <= SMALL_PARTITION_BLOCK else MAX_PARTITIONS


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_partitions: int | None = None,
    config: DecodeLaunchConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (row i is sequence i's one new token) -> out [B, Hq, D].

    seq_lens int32 [>= B] and block_tables int32 [>= B, max_blocks] stay on the device. A row with
    seq_len 0 (batch padding) gets zeros. num_partitions=None picks by choose_num_partitions; config=None
    picks by choose_config.
    k_scale, v_scale (host floats): a float8 cache's scales; other caches ignore them.
    window: the layer's sliding window (None: none): the token sees only the last `window` keys, and the
    keys before them are never read (their block-table entries may be 0).
    """
    check_attention_inputs(q, kv_cache, block_tables)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be at least 1 (None for no window)")
    max_context_len = block_tables.shape[1] * block_size
    sm_count = _sm_count(q.device.index or 0)
    block_d = next_power_of_2(head_dim)
    if num_partitions is None:
        tile_tokens = config.tile_tokens if config is not None else split_tile_tokens(head_dim)
        num_partitions = choose_num_partitions(
            num_seqs, num_kv_heads, max_context_len, sm_count, tile_tokens, window
        )
    if config is None:
        shared_memory = shared_memory_per_block(kernel_capability(q.device))
        config = choose_config(
            num_seqs, num_kv_heads, num_partitions, sm_count, head_dim, shared_memory, kv_cache.element_size()
        )
    block_g = max(16, next_power_of_2(queries_per_kv))
    partition_block = partition_block_size(num_partitions)
    write_direct = num_partitions == 1
    if write_direct:
        part_out = part_max = part_sum = out  # unused by the kernel
    else:
        part_max = torch.empty((num_seqs, num_q_heads, num_partitions), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty(
            (num_seqs, num_q_heads, num_partitions, block_d), dtype=torch.float32, device=q.device
        )
    k_scale, v_scale = kv_cache_scales(kv_cache, k_scale, v_scale)
    _decode_partition_kernel[(num_kv_heads, num_seqs, num_partitions)](
        q,
        kv_cache_for_kernels(kv_cache, q.dtype),
        block_tables,
        seq_lens,
        out,
        part_out,
        part_max,
        part_sum,
        scale * k_scale * math.log2(math.e),
        v_scale,
        num_partitions,
        window or 0,
        head_dim,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        TILE_N=config.tile_tokens,
        WRITE_DIRECT=write_direct,
        HAS_WINDOW=window is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_kwargs(q.device),
    )
    if not write_direct:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            seq_lens,
            num_partitions,
            window or 0,
            head_dim,
            out.stride(0),
            out.stride(1),
            BLOCK_D=block_d,
            PARTITION_BLOCK=partition_block,
            TILE_N=config.tile_tokens,
            HAS_WINDOW=window is not None,
            # [PARTITION_BLOCK, BLOCK_D] float32 partials: 4 warps spill 4 KB a thread at 512 (ptxas -v)
            num_warps=4 if block_d <= 256 else 8,
            **pdl_kwargs(q.device),
        )
    return out
