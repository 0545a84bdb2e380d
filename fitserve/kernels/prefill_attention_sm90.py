"""Paged prefill attention for Hopper (sm_90), in Gluon: warpgroup MMAs issued and awaited explicitly.

The Triton kernel (kernels/prefill_attention.py) reaches ~375 TFLOP/s on an H100 at long prompts, and no
reordering of its loop helped: Triton waits for each warpgroup MMA right after issuing it, and a loop that
issues the next tile's q @ k.T early made it wait on every MMA instead
(benchmarks/results/h100_prefill_attention_trials.json). Here each step issues key tile j's q @ k.T, rescales
the accumulator while it runs, issues tile j - 1's p @ v behind it, waits for the scores only, and computes
tile j's softmax; keys and values arrive by cp.async (each key's row looked up in the block table, so any
cache block size works) NUM_STAGES - 2 tiles ahead. ptxas still moves the second wait ahead of the softmax
(sm_90 SASS), so most of the overlap between softmax and tensor cores comes from the SM's other warpgroups:
the long-query config runs two programs of two warpgroups an SM. On an H100 that gives 407-426 TFLOP/s
where the Triton kernel gives 371-378 (LONG_QUERY_SM90_CONFIG below).

The same problem as the Triton kernel (one program per sequence, KV head and query tile; its BLOCK_M rows
are query tokens x the query heads of one KV head; causal; the sequence's cached prefix read from the
paged cache like its new tokens), restricted to what it was measured on: bf16 / fp16 queries and cache (no
float8 cache), head dim 64 or 128, no sliding window. `supports_sm90` says when it applies;
kernels/prefill_attention.py routes to it. Warpgroup MMA exists on sm_90 only.

Reference: fitserve.kernels.reference.paged_attention_reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fitserve.kernels.attention_inputs import prefill_strides
from fitserve.kernels.fast_launch import INTERPRETING, fast_launch
from fitserve.kernels.grid_math import cdiv, next_power_of_2

CAPABILITY = (9, 0)  # warpgroup MMA: sm_90 (H100, H200, H20, GH200) only
SUPPORTED_HEAD_DIMS = (64, 128)


def supports_sm90(
    q: torch.Tensor, kv_cache: torch.Tensor, window: int | None, capability: tuple[int, int] | None
) -> bool:
    """Whether this kernel runs the step: an sm_90 GPU (not Triton's interpreter, which has no Gluon), a
    16-bit cache of the queries' dtype, head dim 64 or 128, no window."""
    return (
        capability == CAPABILITY
        and not INTERPRETING
        and window is None
        and q.dtype in (torch.bfloat16, torch.float16)
        and kv_cache.dtype == q.dtype
        and q.shape[-1] in SUPPORTED_HEAD_DIMS
    )


@gluon.jit
def _issue_tile(k_smem, v_smem, stage, k_base, v_base, block_row, key_start, key_end, stride_cache_block,
                stride_cache_slot, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                load_layout: gl.constexpr):  # fmt: skip
    """cp.async of key tile [key_start, key_start + BLOCK_N) into `stage` of the rings; keys at or past
    key_end are not read (their rows are zero-filled), so a tile past the end costs no memory traffic."""
    keys = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load_layout))
    present = keys < key_end
    block = gl.load(block_row + keys // BLOCK_SIZE, mask=present, other=0).to(gl.int64)
    rows = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
    dims = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, load_layout))
    offsets = rows[:, None] + dims[None, :]
    async_copy.async_copy_global_to_shared(k_smem.index(stage), k_base + offsets, mask=present[:, None])
    async_copy.async_copy_global_to_shared(v_smem.index(stage), v_base + offsets, mask=present[:, None])
    async_copy.commit_group()


@gluon.jit
def _row_offsets(first_query, kv_head, q_start, q_len, stride_tok, stride_head, QUERIES_PER_KV: gl.constexpr,
                 BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Each of the tile's rows (query token x query head of the KV group) as an offset into q / out, and
    whether it is one (rows past the group's heads or the sequence's queries are not)."""
    rows = gl.arange(0, BLOCK_M, layout=layout)
    query_local = first_query + rows // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (query_local < q_len)
    return (q_start + query_local).to(gl.int64) * stride_tok + heads * stride_head, valid


@gluon.jit
def _masked(scores, key_start, query_pos, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    keys = key_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where(keys[None, :] <= query_pos[:, None], scores, float("-inf"))


@gluon.jit
def _tile_step(tile, p_op, acc, alpha, m_i, l_i, q_smem, k_smem, v_smem, k_base, v_base, block_row,
               key_end, unmasked_end, query_pos, qk_scale_log2, stride_cache_block, stride_cache_slot, s_zero,
               BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_SIZE: gl.constexpr,
               NUM_STAGES: gl.constexpr, load_layout: gl.constexpr, s_layout: gl.constexpr,
               o_layout: gl.constexpr, p_layout: gl.constexpr):  # fmt: skip
    """Key tile `tile` (>= 1): its scores and softmax, and the previous tile's p @ v (p_op, the previous
    tile's probabilities; acc and alpha, the accumulator and the rescale it still owes). Returns this
    tile's probabilities and the running state."""
    # The stage of tile - 2 is free (both its MMAs were waited for): the tile NUM_STAGES - 2 ahead goes
    # there, issued first so that its copy has the rest of this step and the next to land.
    ahead = tile + NUM_STAGES - 2
    _issue_tile(k_smem, v_smem, ahead % NUM_STAGES, k_base, v_base, block_row, ahead * BLOCK_N, key_end,
                stride_cache_block, stride_cache_slot, BLOCK_N, BLOCK_D, BLOCK_SIZE, load_layout)  # fmt: skip
    async_copy.wait_group(NUM_STAGES - 2)
    fence_async_shared()
    gl.thread_barrier()
    # This tile's scores go to the tensor cores first; the accumulator takes the rescale it owes meanwhile
    # (it is not in flight), then the previous tile's p @ v follows.
    scores_token = warpgroup_mma(
        q_smem, k_smem.index(tile % NUM_STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True
    )
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc_token = warpgroup_mma(p_op, v_smem.index((tile - 1) % NUM_STAGES), acc, is_async=True)
    scores = warpgroup_mma_wait(1, deps=(scores_token,))
    key_start = tile * BLOCK_N
    if key_start + BLOCK_N > unmasked_end:
        scores = _masked(scores, key_start, query_pos, BLOCK_N, s_layout)
    m_new = gl.maximum(m_i, gl.max(scores, axis=1) * qk_scale_log2)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(scores * qk_scale_log2 - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_next = gl.convert_layout(p.to(p_op.dtype), p_layout)
    # p_op stays live until p @ v is done (it reads those registers); p_next rides along
    acc, _, p_next = warpgroup_mma_wait(0, deps=(acc_token, p_op, p_next))
    return p_next, acc, alpha, m_new, l_i


@fast_launch
# stride_bt_seq: the step's widest block table, any value: one compile (as the Triton kernel)
@gluon.jit(do_not_specialize=["stride_bt_seq"])
def _prefill_sm90_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_out_tok,
    stride_out_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_seq,
    QUERIES_PER_KV: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    q_tile = gl.num_programs(2) - 1 - gl.program_id(2)  # the tiles that see the most keys start first

    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    first_query = q_tile * BLOCK_Q
    if first_query < q_len:
        seq_len = gl.load(seq_lens_ptr + seq)
        context_start = seq_len - q_len
        key_end = context_start + gl.minimum(first_query + BLOCK_Q, q_len)
        # keys below this are seen by every row of the tile: tiles that end by it need no causal mask
        unmasked_end = context_start + first_query + 1

        # 16-byte vectors along the head dim for every load; rows spread over the rest of the warp
        threads_along_d: gl.constexpr = BLOCK_D // 8
        load_layout: gl.constexpr = gl.BlockedLayout(
            [1, 8], [32 // threads_along_d, threads_along_d], [num_warps, 1], [1, 0]
        )
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
        kv_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], q_smem_layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], kv_smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], kv_smem_layout)

        k_base = cache_ptr + kv_head * stride_cache_head
        v_base = k_base + stride_cache_kv
        block_row = block_tables_ptr + seq.to(gl.int64) * stride_bt_seq
        # tiles 0 .. NUM_STAGES - 2 now; each step issues the tile NUM_STAGES - 2 past its own
        for first in gl.static_range(NUM_STAGES - 1):
            _issue_tile(k_smem, v_smem, first, k_base, v_base, block_row, first * BLOCK_N, key_end,
                        stride_cache_block, stride_cache_slot, BLOCK_N, BLOCK_D, BLOCK_SIZE,
                        load_layout)  # fmt: skip

        q_rows, q_valid = _row_offsets(
            first_query, kv_head, q_start, q_len, stride_q_tok, stride_q_head, QUERIES_PER_KV, BLOCK_Q,
            BLOCK_M, gl.SliceLayout(1, load_layout),
        )  # fmt: skip
        dims = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, load_layout))
        q = gl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=q_valid[:, None], other=0.0)
        q_smem.store(q)

        s_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        query_pos = context_start + first_query + s_rows // QUERIES_PER_KV
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        num_tiles = gl.cdiv(key_end, BLOCK_N)

        # tile 0: its scores alone (no p @ v in flight yet)
        async_copy.wait_group(NUM_STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        scores = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(0, deps=(scores,))
        if unmasked_end < BLOCK_N:
            scores = _masked(scores, 0, query_pos, BLOCK_N, s_layout)
        m_i = gl.max(scores, axis=1) * qk_scale_log2
        p = gl.exp2(scores * qk_scale_log2 - m_i[:, None])
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
        alpha = gl.full([BLOCK_M], 1.0, gl.float32, gl.SliceLayout(1, s_layout))

        for tile in range(1, num_tiles):
            p_op, acc, alpha, m_i, l_i = _tile_step(
                tile, p_op, acc, alpha, m_i, l_i, q_smem, k_smem, v_smem, k_base, v_base, block_row,
                key_end, unmasked_end, query_pos, qk_scale_log2, stride_cache_block, stride_cache_slot,
                s_zero, BLOCK_N, BLOCK_D, BLOCK_SIZE, NUM_STAGES, load_layout, s_layout, o_layout, p_layout,
            )  # fmt: skip

        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc_token = warpgroup_mma(p_op, v_smem.index((num_tiles - 1) % NUM_STAGES), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=(acc_token, p_op))
        async_copy.wait_group(0)

        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        out_rows, out_valid = _row_offsets(
            first_query, kv_head, q_start, q_len, stride_out_tok, stride_out_head, QUERIES_PER_KV, BLOCK_Q,
            BLOCK_M, gl.SliceLayout(1, o_layout),
        )  # fmt: skip
        o_dims = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
        gl.store(out_ptr + out_rows[:, None] + o_dims[None, :], out.to(dtype), mask=out_valid[:, None])


@dataclass(frozen=True)
class Sm90PrefillConfig:
    block_m: int  # query rows (tokens x heads of one KV group) per program: 16 a warp
    block_n: int  # keys per tile
    num_stages: int  # key/value tiles in shared memory (at least 3: two in use, one arriving)
    num_warps: int  # 4 (one warpgroup) or 8 (two, each on its half of the rows)

    def __post_init__(self) -> None:
        problems = []
        if self.num_stages < 3:
            problems.append(f"num_stages={self.num_stages} is below 3 (two tiles in use, one arriving)")
        if self.num_warps not in (4, 8):
            problems.append(f"num_warps={self.num_warps} is not 4 or 8 (one or two warpgroups)")
        if self.block_m < 16 * self.num_warps or self.block_m & (self.block_m - 1):
            problems.append(f"block_m={self.block_m} is not a power of two of at least 16 a warp")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            problems.append(f"block_n={self.block_n} is not a power of two of at least 16 (one MMA's depth)")
        if problems:
            raise ValueError(
                f"Sm90PrefillConfig: {'; '.join(problems)}; LONG_QUERY_SM90_CONFIG and "
                "SHORT_QUERY_SM90_CONFIG are the measured ones"
            )


# On an H100 (benchmarks/gpu/prefill_attention_sm90.py, benchmarks/results/h100_prefill_attention_sm90.json):
# two warpgroups on 128 rows and 32-key tiles, two programs an SM, for long queries (the Triton kernel's
# long-query threshold): 407-426 TFLOP/s on an 8k prompt and 4-8k chunks at 24-32k against the Triton
# kernel's 371-378, 4 x 2k 346 against 311; one warpgroup on 64 rows for steps of short queries and decode
# rows beside a chunk (a decode row fills a tile's first token only): 253 against 289 us for a 1k chunk
# beside 32 decodes, 183.6 against 205.6 for 768 prompt tokens beside 128 (the long config: 278, 187.7).
LONG_QUERY_SM90_CONFIG = Sm90PrefillConfig(block_m=128, block_n=32, num_stages=3, num_warps=8)
SHORT_QUERY_SM90_CONFIG = Sm90PrefillConfig(block_m=64, block_n=32, num_stages=3, num_warps=4)


def choose_sm90_config(num_tokens: int, num_seqs: int, long_query_min_mean: int) -> Sm90PrefillConfig:
    """The long-query config from a mean of `long_query_min_mean` query tokens a sequence, else the short."""
    if num_tokens >= long_query_min_mean * num_seqs:
        return LONG_QUERY_SM90_CONFIG
    return SHORT_QUERY_SM90_CONFIG


def paged_prefill_attention_sm90(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    config: Sm90PrefillConfig,
) -> torch.Tensor:
    """kernels/prefill_attention.paged_prefill_attention's contract (its checks done by the caller), for the
    inputs supports_sm90 accepts."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_q_heads // num_kv_heads
    # 16 rows a warp at least; a query token's heads never split over tiles (check_attention_inputs allows
    # at most 64 a KV head), so a group of 7 takes 18 tokens of a 128-row tile and leaves 2 rows idle
    block_m = max(config.block_m, 16 * config.num_warps, next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    grid = (seq_lens.shape[0], num_kv_heads, cdiv(max_query_len, block_q))
    _prefill_sm90_kernel[grid](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * math.log2(math.e),
        *prefill_strides(q, out, kv_cache, block_tables),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=head_dim,
        BLOCK_SIZE=block_size,
        NUM_STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return out
