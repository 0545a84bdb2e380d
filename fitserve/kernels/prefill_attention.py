"""Paged attention for prefill and mixed batches: variable-length queries over the paged KV cache.

On an sm_90 GPU, paged_prefill_attention hands the steps kernels/prefill_attention_sm90.py supports (16-bit
caches at head dims 64 and 128, no window) to that Gluon kernel; this Triton kernel runs the rest (float8
caches, windows, wider heads) and every other GPU's steps. The H100 figures below are this kernel's.

Runs after the step's new keys/values are in the cache, so a sequence's cached prefix (prefix-cache
hit, earlier chunk, earlier decode steps) and its new tokens are read the same way: chunked prefill
and prefix caching are this one path. A program takes one (sequence, KV head, query tile); its
BLOCK_M rows are BLOCK_Q query tokens x the QUERIES_PER_KV heads sharing that KV head, so keys and
values are loaded once per group, and a decode row in a mixed batch still fills several rows.
Keys are tiled by BLOCK_N with an online softmax; the causal bound stops the key loop at the last
query's position. A float8 cache is read as in the decode kernel: keys and values converted to the
query dtype, k_scale folded into the score scale, v_scale applied to the output (runtime floats); below
compute capability 8.9 an e4m3 cache comes as its bytes (uint8), decoded by kernels/fp8_bits.py.
That read is exact (every e4m3/e5m2 value is a bf16/fp16 value), so the only rounding is the one a bf16
cache has too: p rounded to the query dtype for the P @ V dot, which moves an output element by at most
2**-8 * max|V| for bf16 (tests/gpu/test_kernels_fp8.py sets its tolerance from that).

A sliding window (Gemma-4's sliding layers; `window`): query position p sees keys p - window + 1 .. p.
A tile's key loop starts at the tile holding the oldest key its earliest query sees; the keys before
that are never loaded (their block-table entries may be the null block 0, whose memory another request
reuses), and each element is masked by its own row's window. The tiles every row sees whole still run
unmasked. Without a window (HAS_WINDOW False) the kernel compiles to the code it had before windows.

Reference: fitserve.kernels.reference.paged_attention_reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from fitserve.kernels.attention_inputs import (
    check_attention_inputs,
    kv_cache_for_kernels,
    kv_cache_scales,
    prefill_strides,
)
from fitserve.kernels.capability import SHARED_MEMORY_PER_BLOCK, kernel_capability, shared_memory_per_block
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.fp8_bits import stored_values
from fitserve.kernels.grid_math import cdiv, next_power_of_2

try:
    from fitserve.kernels.prefill_attention_sm90 import (
        choose_sm90_config,
        paged_prefill_attention_sm90,
        supports_sm90,
    )
except ImportError:  # a Triton without Gluon's Hopper ops (before 3.6): this module's kernel runs everywhere
    supports_sm90 = None


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
# Wider heads (Gemma-4's 256 on its sliding layers, 512 on its full ones), chosen so that no variant spills
# registers (ptxas -v for sm_90a, the window variant too: it holds the most): the [BLOCK_M, D] float32
# accumulator takes BLOCK_M * D / (32 * num_warps) registers a thread. At 256, 8 warps: 64 rows on
# warpgroup MMA take 172-190 registers, and long queries 128 rows (two warpgroups of 64, as
# FlashAttention-3 tiles head dim 256) 240-254, where the 128-dim long-query config's 4 warps and three
# stages spill 3.6 KB a thread. At 512 a 64-row tile spills at any warp count (8: 96-160 bytes; 16 warps
# cap a thread at 128 registers), so 32 rows (4 query tokens of a group of 8 heads) over 8 warps,
# 206-218 registers, with 32-key tiles (98 KB of shared memory).
HEAD_256_CONFIG = PrefillLaunchConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
HEAD_256_LONG_QUERY_CONFIG = PrefillLaunchConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)
WIDE_HEAD_CONFIG = PrefillLaunchConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
LONG_QUERY_MIN_MEAN = 512  # mean query tokens per sequence from which the long-query config runs
# HEAD_256_LONG_QUERY_CONFIG asks 104 KB of shared memory (sm_86 build): GPUs whose blocks may have less
# (sm_86 / sm_89: 99 KB) run HEAD_256_CONFIG for long queries too (kernels/variants.py checks them all).
HEAD_256_LONG_QUERY_MIN_SHARED = 112 * 1024
# Long queries over a float8 cache (its bytes decoded in the kernel, kernels/fp8_bits.py) on Hopper: the
# 16-bit long-query config spills there (255 registers and 40 bytes a thread, sm_90), 128 x 128 tiles on 8
# warps do not (237 registers, 128 KB of shared memory). H200, 8B heads, an e4m3 cache
# (benchmarks/results/h200_e4m3_kv_bytes.json): one 8k prompt 288 -> 319 TFLOP/s, an 8k chunk at 24k-32k
# 284 -> 302, 4 x 2k 262 -> 266. Below Hopper that tile spills 1.4 KB (sm_80 to sm_89): the 16-bit choice.
FLOAT8_LONG_QUERY_CONFIG = PrefillLaunchConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
FLOAT8_LONG_QUERY_MIN_SHARED = 200 * 1024


def fma_dot_shared_bytes(block_m: int, block_n: int, block_d: int) -> int:
    """Shared memory of the kernel where Triton has no tensor-core MMA (below sm_80: Triton 3.6 lowers
    tl.dot to FMAs there, both operands of q @ k.T staged as float32): [BLOCK_M, D] and [D, BLOCK_N]."""
    return (block_m + block_n) * block_d * 4


def fit_without_tensor_cores(
    config: PrefillLaunchConfig, block_d: int, shared_memory: int
) -> PrefillLaunchConfig:
    """`config` with fewer query rows, then fewer keys (down to 16 each), until fma_dot_shared_bytes fits
    (sm_75 at head dim 128: 64 x 32 for the long-query tile; 256: 32 x 32; 512: 16 x 16)."""
    while True:
        block_n = config.block_n if block_d <= 128 else min(config.block_n, 32)
        if fma_dot_shared_bytes(config.block_m, block_n, block_d) <= shared_memory:
            return config
        if config.block_m > 16 and config.block_m >= block_n:
            config = replace(config, block_m=config.block_m // 2)
        elif block_n > 16:
            config = replace(config, block_n=block_n // 2)
        else:
            return config


def choose_prefill_config(
    num_tokens: int,
    num_seqs: int,
    head_dim: int = 128,
    shared_memory: int = SHARED_MEMORY_PER_BLOCK[(9, 0)],
    tensor_cores: bool = True,
    kv_element_bytes: int = 2,
) -> PrefillLaunchConfig:
    """The launch config for a step of `num_tokens` query tokens over `num_seqs` sequences, of heads of
    `head_dim` (up to 128: the tuned 128 configs, FLOAT8_LONG_QUERY_CONFIG for long queries over a float8
    cache, `kv_element_bytes` 1, where a block may have FLOAT8_LONG_QUERY_MIN_SHARED; up to 256:
    HEAD_256_*; above: WIDE_HEAD_CONFIG), on a GPU whose blocks may have `shared_memory` bytes
    (kernels/capability.py; the H100's by default); without tensor cores (Triton's, below sm_80) cut down
    by fit_without_tensor_cores."""
    block_d = next_power_of_2(head_dim)
    long_queries = num_tokens >= LONG_QUERY_MIN_MEAN * num_seqs
    if block_d > 256:
        config = WIDE_HEAD_CONFIG
    elif block_d > 128:
        wide_fits = shared_memory >= HEAD_256_LONG_QUERY_MIN_SHARED
        config = HEAD_256_LONG_QUERY_CONFIG if long_queries and wide_fits else HEAD_256_CONFIG
    elif long_queries and kv_element_bytes == 1 and shared_memory >= FLOAT8_LONG_QUERY_MIN_SHARED:
        config = FLOAT8_LONG_QUERY_CONFIG
    else:
        config = LONG_QUERY_CONFIG if long_queries else DEFAULT_PREFILL_CONFIG
    return config if tensor_cores else fit_without_tensor_cores(config, block_d, shared_memory)


@triton.jit
def _online_softmax_update(scores, v, m_i, l_i, acc):
    """One key tile of the online softmax where a row may see none of the tile's keys (a window's edge,
    or a row whose window starts past the tile): such a row's max stays -inf, so it is subtracted as 0
    (exp2(-inf - 0) = 0) instead of giving exp2(-inf - -inf) = NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(scores - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@host_launched
# stride_bt_seq: the step's widest block table, any value: one compile (and the window, fixed per layer)
@triton.jit(do_not_specialize=["stride_bt_seq", "window"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale_log2,
    v_scale,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EVEN_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
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
    unmasked_start = 0
    if HAS_WINDOW:
        # The oldest key any row sees (the tile's first query's window) and the first tile every row's
        # window holds whole (the last query's); the tiles between are masked by each row's window.
        window_lo = context_start + first_query - window + 1
        loop_start = tl.maximum(window_lo, 0) // BLOCK_N * BLOCK_N
        unmasked_start = tl.cdiv(tl.maximum(context_start + last_query - window + 1, 0), BLOCK_N) * BLOCK_N
        unmasked_start = tl.minimum(unmasked_start, full_end)
        for key_start in range(loop_start, unmasked_start, BLOCK_N):
            keys = key_start + tl.arange(0, BLOCK_N)
            key_mask = keys >= window_lo
            block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
            key_rows = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
            kv_mask = key_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            k = stored_values(k, q.dtype)
            v = tl.load(v_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = stored_values(v, q.dtype)
            scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
            scores = tl.where(keys[None, :] > query_pos[:, None] - window, scores, float("-inf"))
            m_i, l_i, acc = _online_softmax_update(scores, v, m_i, l_i, acc)
    for key_start in range(unmasked_start, full_end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        block = tl.load(block_row + keys // BLOCK_SIZE).to(tl.int64)
        key_rows = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        if EVEN_D:
            k = stored_values(tl.load(k_base + key_rows[:, None] + dims[None, :]), q.dtype)
            v = stored_values(tl.load(v_base + key_rows[:, None] + dims[None, :]), q.dtype)
        else:
            k = tl.load(k_base + key_rows[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
            v = tl.load(v_base + key_rows[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
            k = stored_values(k, q.dtype)
            v = stored_values(v, q.dtype)
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
        if HAS_WINDOW:  # with a window shorter than the tile, even these may start before it
            key_mask = key_mask & (keys >= context_start + first_query - window + 1)
        block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        key_rows = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        k = stored_values(
            tl.load(k_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0), q.dtype
        )
        v = stored_values(
            tl.load(v_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0), q.dtype
        )
        scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
        visible = (keys[None, :] <= query_pos[:, None]) & key_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_i, l_i, acc = _online_softmax_update(scores, v, m_i, l_i, acc)
        else:
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
    window: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] in the token layout of AttentionMetadata -> out [T, Hq, D].

    query_start_loc int32 [B+1], seq_lens int32 [B], block_tables int32 [B, max_blocks] on the device;
    max_query_len (host int) only sizes the grid. Sequence i's queries are the last q_len_i tokens of
    its seq_lens[i]-token context, whose keys/values must already be in kv_cache. k_scale, v_scale
    (host floats): a float8 cache's scales; other caches ignore them. config: None chooses one by the
    step's mean query length and the head dim (choose_prefill_config). window: the layer's sliding
    window (None: none): query position p sees keys p - window + 1 .. p, and older keys are never read
    (their block-table entries may be 0). With config None, an sm_90 GPU runs the steps
    kernels/prefill_attention_sm90.py supports there.
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
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be at least 1 (None for no window)")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = next_power_of_2(head_dim)
    if config is None:
        capability = kernel_capability(q.device)
        if supports_sm90 is not None and supports_sm90(q, kv_cache, window, capability):
            sm90_config = choose_sm90_config(num_tokens, num_seqs, LONG_QUERY_MIN_MEAN)
            return paged_prefill_attention_sm90(
                q, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len, scale, out, sm90_config
            )
        tensor_cores = capability is None or capability >= (8, 0)
        shared_memory = shared_memory_per_block(capability)
        config = choose_prefill_config(
            num_tokens, num_seqs, head_dim, shared_memory, tensor_cores, kv_cache.element_size()
        )
    block_m = max(config.block_m, next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    block_n = config.block_n if block_d <= 128 else min(config.block_n, 32)
    grid = (num_seqs, num_kv_heads, cdiv(max_query_len, block_q))
    k_scale, v_scale = kv_cache_scales(kv_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q,
        kv_cache_for_kernels(kv_cache, q.dtype),
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * k_scale * math.log2(math.e),
        v_scale,
        window or 0,
        head_dim,
        *prefill_strides(q, out, kv_cache, block_tables),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        EVEN_D=block_d == head_dim,
        HAS_WINDOW=window is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
