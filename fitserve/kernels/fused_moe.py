"""Fused mixture-of-experts: out[t] = the sum over t's k experts e of w[t, e] * down_e(act(gate_e(x[t])) *
up_e(x[t])), with the weights as fitserve/layers/moe.py stores them (gate_up_proj [E, 2I, hidden], gate rows
then up rows; down_proj [E, hidden, I]), in four kernels and without any host sync, so a captured CUDA graph
replays correctly for any routing. (Decode-sized batches take kernels/moe_decode.py's two kernels instead,
`fused_moe` decides; the grouped path below serves every other batch.)

1. routing (`_moe_align_kernel`, one program): counts the (token, slot) pairs of each of this rank's experts
   (tl.histogram), pads each expert's count to BLOCK_M, and writes the pairs grouped by expert into
   `sorted_pairs` (padding rows hold the sentinel num_pairs), each BLOCK_M block's expert into
   `block_expert` and the number of blocks in use into `num_blocks` (a device tensor). The buffers are sized
   on the host for the worst case, so their shapes depend only on T: for P = T * k pairs at most
   (P + min(E, P) * (BLOCK_M - 1)) rows (each expert with pairs pads by at most BLOCK_M - 1; at most P
   experts have pairs), and at most P blocks. Each pair takes its slot with an atomic
   increment of its expert's cursor: in the same program for decode-sized batches (one launch), else in
   `_moe_scatter_kernel` over many programs. The order inside an expert's rows is whatever the
   atomics give; each row's result does not depend on it.
2. GEMM 1 (`_moe_gate_up_kernel`): each program takes one BLOCK_M block of rows (all of one expert) and
   BLOCK_N intermediate columns, multiplies the gathered x rows by that expert's gate rows and up rows (two
   accumulators) and stores act(gate) * up -> `hidden_mid` [rows, I]. The activation is a constexpr: SiLU
   (Qwen3.5/3.6), GELU with the tanh approximation (Gemma-4) or exact GELU.
3. GEMM 2 (`_moe_down_kernel`): `hidden_mid` x down_e, times the pair's top-k weight, written to the pair's
   row of `per_pair` [T * k, hidden] in the input dtype.
4. `_moe_sum_kernel`: out[t] = the sum of t's k rows of `per_pair` in float32, in the input dtype; slots
   routed to another rank's experts (expert parallel) are skipped, so nothing needs zeroing first.

Blocks past `num_blocks` exit at once: the grid is sized for the worst case. Only the experts that some
pair chose are read, so at batch 1 a layer reads its k experts' weights and nothing else.

Why a [T * k, hidden] buffer and a sum rather than float32 atomics into the output: the atomics need a
float32 accumulator zeroed before GEMM 2 and a cast after it (the same number of launches as the sum), move
about as many bytes (4-byte atomics on T * hidden floats k times, the memset and the cast, against 2-byte
writes and reads of T * k rows), and sum the k rows in a different order on every run. The buffer gives
the same result on every replay and rounds as the torch path does (each weighted row to the input dtype,
then one sum). benchmarks/gpu/fused_moe_bench.py reports the sum kernel's share of the time.

Expert parallel: pairs whose expert is outside [first_expert, first_expert + local_experts) are skipped
(contribute zero). Tensor parallel: I is this rank's slice and nothing else changes.

Tile configs come from `choose_config(num_tokens, hidden, intermediate, ...)`, a plain function (no
autotuning: fitserve compiles nothing while serving, tests/gpu/test_no_runtime_compiles.py): two buckets,
decode-sized batches (BLOCK_M 16, N split finely enough for ~2 programs per SM at batch 1) and larger ones
(BLOCK_M 64). Neither the tiles nor the kernels specialize on the token or pair count, so each kernel
compiles once per bucket and model.

Reference: FusedExperts.reference in fitserve/layers/moe.py (plain torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels import moe_decode as decode_path
from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import cdiv, next_power_of_2
from fitserve.kernels.moe_parts import ACTIVATIONS, GELU, GELU_TANH, SILU, GemmTile  # noqa: F401 (re-exported)
from fitserve.kernels.moe_parts import activation as _activation
from fitserve.kernels.moe_parts import dot as _dot
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.moe_parts import pair_block as _pair_block

# Pairs per program of the scatter kernel, pairs (and padding rows) per step of the routing kernel, blocks
# per step of its block -> expert pass.
SCATTER_BLOCK = 1024
ALIGN_CHUNK = 1024
EXPERT_OF_BLOCK_CHUNK = 32
SUM_BLOCK = 1024
# Tokens up to which the decode-sized tiles are used.
SMALL_BATCH_TOKENS = 64
# Programs GEMM 1 and 2 aim for at small batches (about two per SM of an H100's 132).
TARGET_PROGRAMS = 256


@dataclass(frozen=True)
class FusedMoeConfig:
    block_m: int
    gate_up: GemmTile
    down: GemmTile
    # the routing kernel places the pairs itself (one launch) rather than a grid of programs
    one_program_routing: bool = True


def _split_n(n: int, blocks_m: int, widths: tuple[int, ...]) -> int:
    """The widest block_n (widths in decreasing order) that still gives TARGET_PROGRAMS programs."""
    for width in widths:
        if cdiv(n, width) * blocks_m >= TARGET_PROGRAMS:
            return width
    return widths[-1]


def choose_config(
    num_tokens: int, hidden: int, intermediate: int, top_k: int = 8, num_experts: int = 128
) -> FusedMoeConfig:
    """Tiles for T tokens of a layer with this hidden size and (this rank's) intermediate size.

    Up to SMALL_BATCH_TOKENS tokens the step reads weights: BLOCK_M 16 (the smallest tensor-core tile),
    N split so that batch 1's k blocks (one per active expert) give ~TARGET_PROGRAMS programs, and the
    routing in one program. Past it, 64 x 64 (gate and up, two accumulators) and 64 x 128 (down) tiles,
    and the pairs placed by a grid of programs. The tiles depend on T only through the bucket, so each
    kernel has two compiled variants per model: the decode graphs (batch 1 is always captured) compile
    the first, startup's profile run (max_num_batched_tokens) the second."""
    if num_tokens <= SMALL_BATCH_TOKENS:
        blocks_m = min(top_k, num_experts)
        gate_up = GemmTile(_split_n(intermediate, blocks_m, (64, 32, 16)), 128, 4, 4)
        down = GemmTile(_split_n(hidden, blocks_m, (128, 64, 32)), 64, 4, 4)
        return FusedMoeConfig(16, gate_up, down)
    return FusedMoeConfig(64, GemmTile(64, 64, 4, 4), GemmTile(128, 64, 8, 3), one_program_routing=False)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows that any routing of num_pairs pairs over num_experts experts can need."""
    # each expert with pairs pads its rows by at most block_m - 1, and needs at most one block per pair
    return min(num_pairs, (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)


@triton.jit
def _expert_of_pairs(topk_ids_ptr, offs, num_pairs, first_expert, local_experts):
    """This rank's expert index of the pairs at offs, and whether the pair is this rank's."""
    in_range = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32) - first_expert
    mine = in_range & (expert >= 0) & (expert < local_experts)
    return tl.where(mine, expert, 0), mine


@triton.jit
def _scatter_pairs(topk_ids_ptr, cursor_ptr, sorted_pairs_ptr, offs, num_pairs, first_expert, local_experts):
    expert, mine = _expert_of_pairs(topk_ids_ptr, offs, num_pairs, first_expert, local_experts)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=mine)
    tl.store(sorted_pairs_ptr + row, offs, mask=mine)


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    cursor_ptr,
    num_pairs,
    first_expert,
    local_experts,
    BLOCK_M: tl.constexpr,
    EXPERTS: tl.constexpr,  # local_experts rounded up to a power of two
    CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    SCATTER: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        expert, mine = _expert_of_pairs(topk_ids_ptr, offs, num_pairs, first_expert, local_experts)
        counts += tl.histogram(expert, EXPERTS, mask=mine)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # each expert's rows end here (padding rows included)
    total = tl.sum(padded, 0)
    used_blocks = total // BLOCK_M
    tl.store(num_blocks_ptr, used_blocks)
    # block b belongs to the expert whose rows end first after b's first row: the number of experts
    # whose rows end at or before it (experts without pairs end where the one before them did)
    block_ends = ends // BLOCK_M
    for block_start in range(0, used_blocks, BLOCK_CHUNK):
        blocks = block_start + tl.arange(0, BLOCK_CHUNK)
        expert_of_block = tl.sum((block_ends[None, :] <= blocks[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, expert_of_block, mask=blocks < used_blocks)
    # every row a padding row (sentinel num_pairs) until a pair takes it; the cursors at the experts' starts
    for row_start in range(0, total, CHUNK):
        rows = row_start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=rows < total)
    tl.store(cursor_ptr + tl.arange(0, EXPERTS), ends - padded)
    if SCATTER:
        tl.debug_barrier()  # the fill and the cursors above are visible to every thread's atomics below
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            _scatter_pairs(
                topk_ids_ptr, cursor_ptr, sorted_pairs_ptr, offs, num_pairs, first_expert, local_experts
            )


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_scatter_kernel(
    topk_ids_ptr,
    cursor_ptr,
    sorted_pairs_ptr,
    num_pairs,
    first_expert,
    local_experts,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _scatter_pairs(topk_ids_ptr, cursor_ptr, sorted_pairs_ptr, offs, num_pairs, first_expert, local_experts)


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    mid_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    top_k,
    hidden,
    intermediate,
    stride_xm,
    stride_we,
    stride_wn,
    stride_mm,
    ACTIVATION: tl.constexpr,
    FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(intermediate, BLOCK_N)
    block_m = pid // blocks_n
    wait_for_previous_kernel(USE_PDL)
    if block_m >= tl.load(num_blocks_ptr):
        return
    expert, rows, pair, row_ok = _pair_block(sorted_pairs_ptr, block_expert_ptr, block_m, num_pairs, BLOCK_M)
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_n = (pid % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < intermediate
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_xm
    gate_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + intermediate * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k + offs_k) < hidden
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
        gate = _dot(a, tl.trans(w_gate), gate, FP32)
        up = _dot(a, tl.trans(w_up), up, FP32)
    mid = _activation(gate, ACTIVATION) * up
    out = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm + offs_n[None, :]
    tl.store(out, mid.to(mid_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    mid_ptr,
    w_ptr,
    topk_weights_ptr,
    per_pair_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    hidden,
    intermediate,
    stride_mm,
    stride_we,
    stride_wn,
    stride_pm,
    FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(hidden, BLOCK_N)
    block_m = pid // blocks_n
    wait_for_previous_kernel(USE_PDL)
    if block_m >= tl.load(num_blocks_ptr):
        return
    expert, rows, pair, row_ok = _pair_block(sorted_pairs_ptr, block_expert_ptr, block_m, num_pairs, BLOCK_M)
    offs_n = (pid % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm
    w_rows = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, intermediate, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k + offs_k) < intermediate
        a = tl.load(a_rows + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(a, tl.trans(w), acc, FP32)
    pair = tl.where(row_ok, pair, 0)
    acc *= tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out = per_pair_ptr + pair.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    tl.store(out, acc.to(per_pair_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@host_launched
@triton.jit
def _moe_sum_kernel(
    per_pair_ptr,
    topk_ids_ptr,
    out_ptr,
    hidden,
    first_expert,
    local_experts,
    stride_pm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden
    wait_for_previous_kernel(USE_PDL)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(topk_ids_ptr + pair).to(tl.int32) - first_expert
        mine = (expert >= 0) & (expert < local_experts)  # another rank's expert: its row was never written
        row = tl.load(per_pair_ptr + pair * stride_pm + cols, mask=col_ok & mine, other=0.0)
        total += row.to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def check_inputs(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    """ValueError naming the tensor and the fix when the shapes or dtypes do not fit."""
    problem = ""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        problem = f"x must be [T, hidden] bfloat16/float16/float32, got {tuple(x.shape)} {x.dtype}"
    elif gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != x.shape[1] or gate_up_proj.shape[1] % 2:
        problem = f"gate_up_proj must be [E, 2I, hidden={x.shape[1]}], got {tuple(gate_up_proj.shape)}"
    elif down_proj.shape != (gate_up_proj.shape[0], x.shape[1], gate_up_proj.shape[1] // 2):
        expected = (gate_up_proj.shape[0], x.shape[1], gate_up_proj.shape[1] // 2)
        problem = f"down_proj must be [E, hidden, I] = {expected}, got {tuple(down_proj.shape)}"
    elif gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        problem = f"weights must be in x's dtype {x.dtype}, got {gate_up_proj.dtype} and {down_proj.dtype}"
    elif gate_up_proj.stride(2) != 1 or down_proj.stride(2) != 1:
        problem = "the weights' last dims must be contiguous (call .contiguous() when loading them)"
    elif topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        problem = (
            f"topk_ids and topk_weights must both be [T={x.shape[0]}, k], got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_weights.shape)}"
        )
    elif topk_ids.dtype not in (torch.int32, torch.int64):
        problem = f"topk_ids must be int32 or int64, got {topk_ids.dtype}"
    if problem:
        raise ValueError(f"fused_moe: {problem}")


def moe_route(
    topk_ids: torch.Tensor, local_experts: int, first_expert: int, block_m: int, one_program: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (contiguous) -> (sorted_pairs [blocks * block_m] int32: pair indices t * k + slot
    grouped by expert, each expert's rows padded to block_m with the sentinel T * k; block_expert [blocks]
    int32: each block's expert, relative to first_expert; num_blocks [1] int32: the blocks in use). Sizes
    are the worst case for T * k pairs (`max_blocks`); entries past the blocks in use are not written.
    one_program: the routing kernel places the pairs itself, else `_moe_scatter_kernel` does."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    blocks = max_blocks(num_pairs, local_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    # tl.histogram's GPU lowering works in at least one bin per lane of a warp
    experts_pow2 = max(next_power_of_2(local_experts), 32)
    cursor = torch.empty(experts_pow2, dtype=torch.int32, device=device)
    routing = (topk_ids, sorted_pairs, block_expert, num_blocks, cursor)
    routing += (num_pairs, first_expert, local_experts)
    align = {
        "BLOCK_M": block_m,
        "EXPERTS": experts_pow2,
        "CHUNK": ALIGN_CHUNK,
        "BLOCK_CHUNK": EXPERT_OF_BLOCK_CHUNK,
        "SCATTER": one_program,
    }
    _launch(_moe_align_kernel, (1,), routing, align, device, num_warps=8)
    if not one_program:
        scatter = (topk_ids, cursor, sorted_pairs, num_pairs, first_expert, local_experts)
        grid = (cdiv(num_pairs, SCATTER_BLOCK),)
        _launch(_moe_scatter_kernel, grid, scatter, {"BLOCK": SCATTER_BLOCK}, device, num_warps=4)
    return sorted_pairs, block_expert, num_blocks


def fused_moe(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
    config: FusedMoeConfig | None = None,
    shared: decode_path.SharedExpert | None = None,
) -> torch.Tensor:
    """x [T, hidden], gate_up_proj [E_local, 2I, hidden], down_proj [E_local, hidden, I], topk_ids [T, k]
    (global expert ids; this rank holds experts first_expert .. first_expert + E_local - 1) and topk_weights
    [T, k] -> this rank's share of the MoE output [T, hidden] in x's dtype. activation: "silu",
    "gelu_tanh" or "gelu". No host sync: the launches depend only on the shapes.

    Decode-sized batches (kernels/moe_decode.py `takes`) run on moe_decode.py's two kernels unless a
    config for the grouped path is given; only they take a shared expert, added with its gate."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    check_inputs(x, gate_up_proj, down_proj, topk_ids, topk_weights)
    num_tokens, hidden = x.shape
    if config is None and decode_path.takes(num_tokens, shared is not None):
        return decode_path.moe_decode(
            x, gate_up_proj, down_proj, topk_ids, topk_weights, activation, first_expert, shared
        )
    if shared is not None:
        raise ValueError(
            f"fused_moe: a shared expert runs only on the decode path (1 to "
            f"{decode_path.MAX_TOKENS_WITH_SHARED} tokens and no grouped-path config); got {num_tokens} "
            "tokens: add the shared expert's output yourself"
        )
    top_k = topk_ids.shape[1]
    local_experts, double_width, _ = gate_up_proj.shape
    intermediate = double_width // 2
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    config = config or choose_config(num_tokens, hidden, intermediate, top_k, local_experts)
    block_m = config.block_m
    num_pairs = num_tokens * top_k
    routed = moe_route(topk_ids, local_experts, first_expert, block_m, config.one_program_routing)
    sorted_pairs, block_expert, num_blocks = routed
    blocks = block_expert.shape[0]
    device = x.device

    fp32 = x.dtype == torch.float32
    mid = torch.empty((blocks * block_m, intermediate), dtype=x.dtype, device=device)
    tile = config.gate_up
    args = (
        x,
        gate_up_proj,
        mid,
        sorted_pairs,
        block_expert,
        num_blocks,
        num_pairs,
        top_k,
        hidden,
        intermediate,
        x.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        mid.stride(0),
    )
    constexprs = {
        "ACTIVATION": ACTIVATIONS[activation],
        "FP32": fp32,
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (blocks * cdiv(intermediate, tile.block_n),)
    _launch(_moe_gate_up_kernel, grid, args, constexprs, device, tile.num_warps)

    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    tile = config.down
    args = (
        mid,
        down_proj,
        topk_weights,
        per_pair,
        sorted_pairs,
        block_expert,
        num_blocks,
        num_pairs,
        hidden,
        intermediate,
        mid.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        per_pair.stride(0),
    )
    constexprs = {
        "FP32": fp32,
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": tile.block_k,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (blocks * cdiv(hidden, tile.block_n),)
    _launch(_moe_down_kernel, grid, args, constexprs, device, tile.num_warps)

    return sum_pair_rows(per_pair, topk_ids, out, first_expert, local_experts)


def sum_pair_rows(
    per_pair: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, first_expert: int, local_experts: int
) -> torch.Tensor:
    """out [T, hidden] = each token's k rows of per_pair [T * k, hidden] summed in float32 (rows of another
    rank's experts skipped): the grouped paths' last kernel."""
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    args = (per_pair, topk_ids, out, hidden, first_expert, local_experts, per_pair.stride(0), out.stride(0))
    constexprs = {"TOP_K": top_k, "BLOCK": SUM_BLOCK}
    grid = (num_tokens, cdiv(hidden, SUM_BLOCK))
    _launch(_moe_sum_kernel, grid, args, constexprs, out.device, num_warps=4)
    return out
