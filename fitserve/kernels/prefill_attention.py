"""Paged attention for prefill and mixed batches: variable-length queries over the paged KV cache.

Runs after the step's new keys/values are in the cache, so a sequence's cached prefix (prefix-cache
hit, earlier chunk, earlier decode steps) and its new tokens are read the same way: chunked prefill
and prefix caching are this one path. A program takes one (sequence, KV head, query tile); its
BLOCK_M rows are BLOCK_Q query tokens x the QUERIES_PER_KV heads sharing that KV head, so keys and
values are loaded once per group, and a decode row in a mixed batch still fills several rows.
Keys are tiled by BLOCK_N with an online softmax; the causal bound stops the key loop at the last
query's position. A float8 cache is read as in the decode kernel: keys and values converted to the
query dtype, k_scale folded into the score scale, v_scale applied to the output (runtime floats).
That read is exact (every e4m3/e5m2 value is a bf16/fp16 value), so the only rounding is the one a bf16
cache has too: p rounded to the query dtype for the P @ V dot, which moves an output element by at most
2**-8 * max|V| for bf16 (tests/gpu/test_kernels_fp8.py sets its tolerance from that).

Reference: fitserve.kernels.reference.paged_attention_reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.attention_inputs import check_attention_inputs, kv_cache_scales
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv, next_power_of_2


@dataclass(frozen=True)
class PrefillLaunchConfig:
    block_m: int = 64  # query rows (tokens x heads of one KV group) per program
    block_n: int = 64  # keys per inner-loop step
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_PREFILL_CONFIG = PrefillLaunchConfig()
# Steps of long queries only (long prompts, chunks of them; no decode rows among them): taller query
# tiles, narrower key tiles, three stages. On the H100, 8B heads (benchmarks/gpu/prefill_attention_configs.py,
# benchmarks/results/h100_prefill_attention_configs.json): one 8k prompt 360 -> 373 TFLOP/s, an 8k chunk at
# 24k-32k 355 -> 376, 4 x 2k 298 -> 324. It would also take 64 prompts of 128 from 72 to 83, but from a
# mean of 512 query tokens only: below, the default's numerics stay (the other config's summation order
# turned a near-tie of tests/gpu/test_engine_gpu.py's greedy Qwen3 run). With decode rows in the step the
# default is faster anyway (one-token queries fill a tenth of a tall tile): 207 against 176 TFLOP/s for a
# 1k chunk beside 32 decodes.
LONG_QUERY_CONFIG = PrefillLaunchConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
# Heads wider than 256 (Gemma-4's 512 on its full-attention layers): a [64, 512] query tile, [16, 512] key
# and value tiles over two stages (64 + 64 KB of shared memory; the long-query config's 128-row tile and
# three stages need 256 KB, more than the H100's 227), and 8 warps for the [64, 512] float32 accumulator.
WIDE_HEAD_CONFIG = PrefillLaunchConfig(block_m=64, block_n=16, num_warps=8, num_stages=2)
LONG_QUERY_MIN_MEAN = 512  # mean query tokens per sequence from which the long-query config runs


def choose_prefill_config(num_tokens: int, num_seqs: int) -> PrefillLaunchConfig:
    """The launch config for a step of `num_tokens` query tokens over `num_seqs` sequences."""
    if num_tokens >= LONG_QUERY_MIN_MEAN * num_seqs:
        return LONG_QUERY_CONFIG
    return DEFAULT_PREFILL_CONFIG


@fast_launch
@triton.jit(do_not_specialize=["stride_bt_seq"])  # the step's widest block table: any value, one compile
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale_log2,
    v_scale,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last query tiles see the most keys: launched first, they do not finish alone at the end.
    q_tile = tl.num_programs(2) - 1 - tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_query = q_tile * BLOCK_Q
    if first_query >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # position of this sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    query_local = first_query + rows // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * QUERIES_PER_KV) & (query_local < q_len)
    # every row (masked ones too) sees key 0, so no row's running max stays -inf
    query_pos = context_start + query_local
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q_offsets = (q_start + query_local).to(tl.int64) * stride_q_tok + heads * stride_q_head
    q = tl.load(
        q_ptr + q_offsets[:, None] + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    last_query = tl.minimum(first_query + BLOCK_Q, q_len) - 1
    key_end = context_start + last_query + 1
    # Keys before the tile's first query are visible to every row: those tiles need no causal mask
    # and no bounds checks. Only the last few tiles, up to the diagonal, are masked.
    full_end = (context_start + first_query) // BLOCK_N * BLOCK_N
    for key_start in range(0, full_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        block = tl.load(block_row + keys // BLOCK_SIZE).to(tl.int64)
        key_rows = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        if EVEN_D:
            k = tl.load(k_base + key_rows[:, None] + dims[None, :]).to(q.dtype)
            v = tl.load(v_base + key_rows[:, None] + dims[None, :]).to(q.dtype)
        else:
            k = tl.load(k_base + key_rows[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
            v = tl.load(v_base + key_rows[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for key_start in range(full_end, key_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_mask = keys < key_end
        block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        key_rows = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
        visible = (keys[None, :] <= query_pos[:, None]) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc * (v_scale / l_i)[:, None]
    out_offsets = (q_start + query_local).to(tl.int64) * stride_out_tok + heads * stride_out_head
    tl.store(
        out_ptr + out_offsets[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: PrefillLaunchConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, Hq, D] in the token layout of AttentionMetadata -> out [T, Hq, D].

    query_start_loc int32 [B+1], seq_lens int32 [B], block_tables int32 [B, max_blocks] on the device;
    max_query_len (host int) only sizes the grid. Sequence i's queries are the last q_len_i tokens of
    its seq_lens[i]-token context, whose keys/values must already be in kv_cache. k_scale, v_scale
    (host floats): a float8 cache's scales; other caches ignore them. config: None chooses one by the
    step's mean query length (choose_prefill_config).
    """
    check_attention_inputs(q, kv_cache, block_tables)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_q_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences: it needs "
            f"num_seqs + 1 = {num_seqs + 1}"
        )
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = next_power_of_2(head_dim)
    if config is None:
        config = choose_prefill_config(num_tokens, num_seqs)
        if block_d > 256:
            config = WIDE_HEAD_CONFIG
    block_m = max(config.block_m, next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    block_n = config.block_n if block_d <= 128 else min(config.block_n, 32)
    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, block_q))
    k_scale, v_scale = kv_cache_scales(kv_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * k_scale * math.log2(math.e),
        v_scale,
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
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        EVEN_D=block_d == head_dim,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
