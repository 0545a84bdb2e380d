"""Fused mixture-of-experts over int4 experts: kernels/fused_moe.py's routing and sum around two grouped GEMMs
that read each expert's weights in kernels/int4_repack.py's layout, dequantizing in registers.

Experts are `PackedExperts`: every expert's projection repacked once at load (repack_int4) and stacked,
qweight int32 [E, N, Kp // 8] and scale_zero [E, G, N, 2]. A program of GEMM 1 takes one BLOCK_M block of
(token, slot) rows of one expert (the routing groups them) and BLOCK_N intermediate columns: per 256-code
block of K it loads its [BLOCK_N, 32] words of the gate rows and of the up rows, and for each nibble j the
[BLOCK_N, 32] codes of K columns 256 b + 32 j .. + 31 (one shift and one AND), dequantizes them as
(code - zero) * scale in float32, rounds once to x's dtype and multiplies with those 32 columns of the
gathered x rows on the tensor cores (a depth-32 dot); act(gate) * up goes to `mid`. GEMM 2 does the same
over the down rows (K = this rank's intermediate size), weights each pair's row and writes it to
`per_pair`; fused_moe's sum kernel adds each token's k rows. No host sync: a decode step is captured in
a CUDA graph as fused_moe's is. Rounding: each weight is rounded once to the activation dtype.
Decode-sized batches (up to moe_int4_decode.MAX_TOKENS tokens) take kernels/moe_int4_decode.py instead.

Reference: each expert dequantized (int4_repack.dequantize_words), rounded to x's dtype, through fused_moe's
arithmetic (layers/moe_int4.py's torch path; tests/unit/test_fused_moe_int4_interpret.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels import moe_int4_decode as decode_path
from fitserve.kernels.capability import kernel_capability
from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.fused_moe import SMALL_BATCH_TOKENS, moe_route, sum_pair_rows
from fitserve.kernels.grid_math import cdiv
from fitserve.kernels.int4_repack import BLOCK_K, WORDS_PER_BLOCK
from fitserve.kernels.moe_parts import ACTIVATIONS
from fitserve.kernels.moe_parts import activation as _activation
from fitserve.kernels.moe_parts import dot as _dot
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.moe_parts import pair_block as _pair_block


@dataclass
class PackedExperts:
    """One projection of every local expert in the int4 kernels' layout, stacked (module docstring)."""

    qweight: torch.Tensor  # int32 [E, N, Kp // 8]
    scale_zero: torch.Tensor  # [E, G, N, 2]: (scale, zero point) in the activation dtype
    group_size: int
    in_features: int  # K
    out_features: int  # N

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]


@triton.jit
def _dequantized_tile(words, sz_rows, n_ok, J: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble J of [BLOCK_N, 32] words -> the [BLOCK_N, 32] weights (code - zero) * scale in DTYPE, with
    sz_rows pointing at the rows' (scale, zero point) pairs of the words' group."""
    codes = ((words >> (4 * J)) & 15).to(tl.float32)
    scale = tl.load(sz_rows, mask=n_ok, other=0.0).to(tl.float32)
    zero = tl.load(sz_rows + 1, mask=n_ok, other=0.0).to(tl.float32)
    return ((codes - zero[:, None]) * scale[:, None]).to(DTYPE)


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_int4_gate_up_kernel(
    x_ptr,
    qw_ptr,
    sz_ptr,
    mid_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    top_k,
    hidden,
    intermediate,
    stride_xm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_mm,
    GROUP: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    offs_w = tl.arange(0, 32)
    x_rows = x_ptr + token[:, None] * stride_xm
    gate_words = qw_ptr + expert * stride_qe + offs_n.to(tl.int64)[:, None] * stride_qn
    up_words = gate_words + intermediate * stride_qn
    gate_sz = sz_ptr + expert * stride_se + offs_n.to(tl.int64) * 2
    up_sz = gate_sz + intermediate * 2
    dtype = x_ptr.dtype.element_ty
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, tl.cdiv(hidden, 256)):
        w_gate = tl.load(gate_words + (b * 32 + offs_w)[None, :], mask=n_ok[:, None], other=0)
        w_up = tl.load(up_words + (b * 32 + offs_w)[None, :], mask=n_ok[:, None], other=0)
        for j in tl.static_range(8):
            k = b * 256 + j * 32 + offs_w
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < hidden)[None, :], other=0.0)
            group = (b * 256 + j * 32) // GROUP
            g_tile = _dequantized_tile(w_gate, gate_sz + group * stride_sg, n_ok, j, dtype)
            u_tile = _dequantized_tile(w_up, up_sz + group * stride_sg, n_ok, j, dtype)
            gate = _dot(a, tl.trans(g_tile), gate, FP32)
            up = _dot(a, tl.trans(u_tile), up, FP32)
    mid = _activation(gate, ACTIVATION) * up
    out = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm + offs_n[None, :]
    tl.store(out, mid.to(mid_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_int4_down_kernel(
    mid_ptr,
    qw_ptr,
    sz_ptr,
    topk_weights_ptr,
    per_pair_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    hidden,
    intermediate,
    stride_mm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_pm,
    GROUP: tl.constexpr,
    FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    offs_w = tl.arange(0, 32)
    a_rows = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm
    words = qw_ptr + expert * stride_qe + offs_n.to(tl.int64)[:, None] * stride_qn
    sz = sz_ptr + expert * stride_se + offs_n.to(tl.int64) * 2
    dtype = mid_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, tl.cdiv(intermediate, 256)):
        w = tl.load(words + (b * 32 + offs_w)[None, :], mask=n_ok[:, None], other=0)
        for j in tl.static_range(8):
            k = b * 256 + j * 32 + offs_w
            a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & (k < intermediate)[None, :], other=0.0)
            group = (b * 256 + j * 32) // GROUP
            tile = _dequantized_tile(w, sz + group * stride_sg, n_ok, j, dtype)
            acc = _dot(a, tl.trans(tile), acc, FP32)
    pair = tl.where(row_ok, pair, 0)
    acc *= tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out = per_pair_ptr + pair.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    tl.store(out, acc.to(per_pair_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def check_inputs(
    x: torch.Tensor, gate_up: PackedExperts, down: PackedExperts, topk_ids: torch.Tensor
) -> None:
    """ValueError naming what does not fit."""
    problem = ""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        problem = f"x must be [T, hidden] bfloat16/float16, got {tuple(x.shape)} {x.dtype}"
    elif gate_up.in_features != x.shape[1] or gate_up.out_features % 2:
        problem = (
            f"gate_up must be [E, 2I, hidden={x.shape[1]}], got N {gate_up.out_features} K "
            f"{gate_up.in_features}"
        )
    elif (down.out_features, down.in_features) != (x.shape[1], gate_up.out_features // 2):
        problem = (
            f"down must be [E, hidden={x.shape[1]}, I={gate_up.out_features // 2}], got N "
            f"{down.out_features} K {down.in_features}"
        )
    elif down.num_experts != gate_up.num_experts:
        problem = f"gate_up holds {gate_up.num_experts} experts, down {down.num_experts}"
    elif gate_up.scale_zero.dtype != x.dtype or down.scale_zero.dtype != x.dtype:
        problem = f"the experts' scales must be in x's dtype {x.dtype} (repack them for it)"
    elif any(group % 32 for group in (gate_up.group_size, down.group_size)):
        problem = f"group sizes must be multiples of 32, got {gate_up.group_size} and {down.group_size}"
    elif topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        problem = f"topk_ids must be [T={x.shape[0]}, k], got {tuple(topk_ids.shape)}"
    if problem:
        raise ValueError(f"fused_moe_int4: {problem}")


def fused_moe_int4(
    x: torch.Tensor,
    gate_up: PackedExperts,
    down: PackedExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [T, hidden] (bfloat16 / float16), gate_up [E_local, 2I, hidden] and down [E_local, hidden, I] as
    PackedExperts, topk_ids / topk_weights [T, k] (global expert ids) -> this rank's share of the MoE
    output [T, hidden] in x's dtype. No host sync. Decode-sized batches (kernels/moe_int4_decode.py
    `takes`) run on moe_int4_decode.py's two kernels, larger ones on the grouped path."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe_int4: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    check_inputs(x, gate_up, down, topk_ids)
    x = x if x.stride(1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if decode_path.takes(x.shape[0]):
        return decode_path.moe_int4_decode(x, gate_up, down, topk_ids, topk_weights, activation, first_expert)
    return grouped_moe_int4(x, gate_up, down, topk_ids, topk_weights, activation, first_expert)


def grouped_moe_int4(
    x: torch.Tensor,
    gate_up: PackedExperts,
    down: PackedExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
) -> torch.Tensor:
    """fused_moe_int4's grouped path: the pairs routed into tiles of one expert, two grouped GEMMs and the
    sum (inputs as fused_moe_int4 has checked and made contiguous)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    local_experts = gate_up.num_experts
    intermediate = gate_up.out_features // 2
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    small = num_tokens <= SMALL_BATCH_TOKENS
    # decode-sized batches: the smallest tensor-core tile of rows; larger ones: 64-row tiles over 8 warps on
    # Hopper, 32 x 32 elsewhere (the 64 x 64 tile's two float32 accumulators and the unrolled dequantization
    # spill on sm_80 / sm_86; kernels/variants.py shows the registers)
    if small:
        block_m, gate_up_n, down_n, warps = 16, 32, 64, 4
    elif (kernel_capability(x.device) or (9, 0)) >= (9, 0):
        block_m, gate_up_n, down_n, warps = 64, 64, 64, 8
    else:
        block_m, gate_up_n, down_n, warps = 32, 32, 64, 4
    num_pairs = num_tokens * top_k
    sorted_pairs, block_expert, num_blocks = moe_route(topk_ids, local_experts, first_expert, block_m, small)
    blocks = block_expert.shape[0]
    device = x.device

    mid = torch.empty((blocks * block_m, intermediate), dtype=x.dtype, device=device)
    qw, sz = gate_up.qweight, gate_up.scale_zero
    args = (x, qw, sz, mid, sorted_pairs, block_expert, num_blocks, num_pairs, top_k, hidden, intermediate)
    args += (x.stride(0), qw.stride(0), qw.stride(1), sz.stride(0), sz.stride(1), mid.stride(0))
    constexprs = {
        "GROUP": gate_up.group_size,
        "ACTIVATION": ACTIVATIONS[activation],
        "FP32": False,
        "BLOCK_M": block_m,
        "BLOCK_N": gate_up_n,
    }
    grid = (blocks * cdiv(intermediate, gate_up_n),)
    _launch(_moe_int4_gate_up_kernel, grid, args, constexprs, device, warps)

    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    qw, sz = down.qweight, down.scale_zero
    args = (mid, qw, sz, topk_weights, per_pair, sorted_pairs, block_expert, num_blocks, num_pairs, hidden)
    args += (intermediate, mid.stride(0), qw.stride(0), qw.stride(1), sz.stride(0), sz.stride(1))
    args += (per_pair.stride(0),)
    constexprs = {"GROUP": down.group_size, "FP32": False, "BLOCK_M": block_m, "BLOCK_N": down_n}
    grid = (blocks * cdiv(hidden, down_n),)
    _launch(_moe_int4_down_kernel, grid, args, constexprs, device, warps)

    return sum_pair_rows(per_pair, topk_ids, out, first_expert, local_experts)


# the layout constants the kernels above are written for
assert BLOCK_K == 256 and WORDS_PER_BLOCK == 32
