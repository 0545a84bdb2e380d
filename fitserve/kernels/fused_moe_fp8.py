"""Fused mixture-of-experts over fp8 experts (an FP8 checkpoint's: Qwen3-30B-A3B-FP8, Qwen3.6-35B-A3B-FP8,
compressed-tensors FP8 MoE releases): kernels/fused_moe.py's grouped path with 1-byte weights, dequantized
in the kernel (weight-only: the activations stay 16-bit, W8A16).

The routing (`fused_moe.moe_route`) and the sum of each token's k rows (`fused_moe.sum_pair_rows`) are
fused_moe.py's; the two GEMMs are its kernels with the weight tile loaded as float8 e4m3, converted to the
activation dtype (exact: every e4m3 value is a bfloat16 and a float16) and scaled in float32:

    w[e, n, k] = float(data[e, n, k]) * scale[e, n, k // GROUP_K]

the canonical fp8 form (layers/quantization/fp8_weight.py) per expert: GROUP_K = K with one scale a row
(per-tensor and per-channel checkpoints), or the block's columns (128 for Qwen's and DeepSeek's
[128, 128] blocks, each block's scale repeated over its rows). With one scale a row the accumulator is
scaled once at the end; with column groups each BLOCK_K step (BLOCK_K divides GROUP_K) multiplies its
partial product by its group's scale before adding it.

Weights as layers/moe_fp8.py keeps them: gate_up [E, 2I, hidden] (gate rows then up rows) with its scale
[E, 2I, G_hidden], down [E, hidden, I] with [E, hidden, G_I]. Every batch size runs these kernels (no
decode-sized variant yet: at one token the tiles are fused_moe.py's small-batch ones). Needs a GPU whose
Triton converts float8 e4m3 (compute capability 8.9 and up: `fp8_experts_run_on`); the CPU and the Triton
interpreter run the same arithmetic. No host sync, so CUDA graphs capture it for any routing.

Reference: layers/moe_fp8.py Fp8FusedExperts.reference (tests/unit/test_fused_moe_fp8_interpret.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import kernel_capability
from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.fused_moe import choose_config, moe_route, sum_pair_rows
from fitserve.kernels.grid_math import cdiv
from fitserve.kernels.moe_parts import ACTIVATIONS
from fitserve.kernels.moe_parts import activation as _activation
from fitserve.kernels.moe_parts import host_launched as _host_launched
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.moe_parts import pair_block as _pair_block

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Fp8Experts:
    """One projection of every local expert: data float8_e4m3fn [E, N, K], scale float32 [E, N, G] with
    G = ceil(K / group_k) (1 for a scale a row)."""

    data: torch.Tensor
    scale: torch.Tensor
    group_k: int


def fp8_experts_run_on(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA at compute capability 8.9 and up (Triton's native e4m3;
    a forced target counts, kernels/capability.py)."""
    capability = kernel_capability(device) if device.type == "cuda" else None
    return capability is not None and capability >= (8, 9)


@triton.jit
def _scaled_step(acc, a, w_tile, s_rows, k, GROUP_K: tl.constexpr, PER_ROW: tl.constexpr, n_ok):
    """acc + a @ dequantized(w_tile).T for one BLOCK_K step at column k: the tile's e4m3 values in a's
    dtype, and with column groups the step's partial product times its group's scale (per row: later)."""
    w = w_tile.to(a.dtype)
    if PER_ROW:
        return tl.dot(a, tl.trans(w), acc)
    scale = tl.load(s_rows + k // GROUP_K, mask=n_ok, other=0.0)
    return acc + tl.dot(a, tl.trans(w)) * scale[None, :]


@_host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_fp8_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
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
    stride_se,
    stride_sn,
    stride_mm,
    ACTIVATION: tl.constexpr,
    GROUP_K: tl.constexpr,
    PER_ROW: tl.constexpr,
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
    rows64 = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_xm
    gate_rows = w_ptr + expert * stride_we + rows64[:, None] * stride_wn
    up_rows = gate_rows + intermediate * stride_wn
    gate_scales = s_ptr + expert * stride_se + rows64 * stride_sn
    up_scales = gate_scales + intermediate * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k + offs_k) < hidden
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
        gate = _scaled_step(gate, a, w_gate, gate_scales, k, GROUP_K, PER_ROW, n_ok)
        up = _scaled_step(up, a, w_up, up_scales, k, GROUP_K, PER_ROW, n_ok)
    if PER_ROW:
        gate *= tl.load(gate_scales, mask=n_ok, other=0.0)[None, :]
        up *= tl.load(up_scales, mask=n_ok, other=0.0)[None, :]
    mid = _activation(gate, ACTIVATION) * up
    out = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm + offs_n[None, :]
    tl.store(out, mid.to(mid_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@_host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_fp8_down_kernel(
    mid_ptr,
    w_ptr,
    s_ptr,
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
    stride_se,
    stride_sn,
    stride_pm,
    GROUP_K: tl.constexpr,
    PER_ROW: tl.constexpr,
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
    rows64 = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm
    w_rows = w_ptr + expert * stride_we + rows64[:, None] * stride_wn
    scales = s_ptr + expert * stride_se + rows64 * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, intermediate, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k + offs_k) < intermediate
        a = tl.load(a_rows + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _scaled_step(acc, a, w, scales, k, GROUP_K, PER_ROW, n_ok)
    if PER_ROW:
        acc *= tl.load(scales, mask=n_ok, other=0.0)[None, :]
    pair = tl.where(row_ok, pair, 0)
    acc *= tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out = per_pair_ptr + pair.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    tl.store(out, acc.to(per_pair_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def check_inputs(x: torch.Tensor, gate_up: Fp8Experts, down: Fp8Experts, topk_ids: torch.Tensor) -> None:
    """ValueError naming the tensor and the fix when the shapes or dtypes do not fit."""
    hidden = x.shape[-1]
    problem = ""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        problem = f"x must be [T, hidden] bfloat16/float16, got {tuple(x.shape)} {x.dtype}"
    elif gate_up.data.dtype != FP8 or down.data.dtype != FP8:
        problem = f"weights must be float8_e4m3fn, got {gate_up.data.dtype} and {down.data.dtype}"
    elif gate_up.data.dim() != 3 or gate_up.data.shape[2] != hidden or gate_up.data.shape[1] % 2:
        problem = f"gate_up must be [E, 2I, hidden={hidden}], got {tuple(gate_up.data.shape)}"
    elif down.data.shape != (gate_up.data.shape[0], hidden, gate_up.data.shape[1] // 2):
        expected = (gate_up.data.shape[0], hidden, gate_up.data.shape[1] // 2)
        problem = f"down must be [E, hidden, I] = {expected}, got {tuple(down.data.shape)}"
    else:
        for name, part in (("gate_up", gate_up), ("down", down)):
            experts, rows, cols = part.data.shape
            groups = cdiv(cols, part.group_k)
            if part.scale.shape != (experts, rows, groups) or part.scale.dtype != torch.float32:
                problem = (
                    f"{name} scale must be float32 [E, N, ceil(K / group_k)] = {(experts, rows, groups)}, "
                    f"got {part.scale.dtype} {tuple(part.scale.shape)}"
                )
            elif part.group_k != cols and part.group_k % 16:
                problem = f"{name} group_k must be K = {cols} or a multiple of 16, got {part.group_k}"
            elif part.data.stride(2) != 1 or part.scale.stride(2) != 1:
                problem = f"{name}'s last dims must be contiguous"
    if not problem and (topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]):
        problem = f"topk_ids must be [T={x.shape[0]}, k], got {tuple(topk_ids.shape)}"
    if problem:
        raise ValueError(f"fused_moe_fp8: {problem}")


def _step_k(tile_k: int, part: Fp8Experts) -> tuple[int, bool]:
    """(BLOCK_K, PER_ROW): with column groups the largest power of two up to the tile's that divides the
    group, so that a step never straddles two scales."""
    cols = part.data.shape[2]
    if part.group_k >= cols:
        return tile_k, True
    block_k = tile_k
    while part.group_k % block_k:
        block_k //= 2
    return block_k, False


def fused_moe_fp8(
    x: torch.Tensor,
    gate_up: Fp8Experts,
    down: Fp8Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [T, hidden] (bfloat16 / float16), this rank's experts first_expert .. first_expert + E - 1,
    topk_ids / topk_weights [T, k] -> this rank's share of the MoE output [T, hidden] in x's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe_fp8: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    check_inputs(x, gate_up, down, topk_ids)
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    local_experts, double_width, _ = gate_up.data.shape
    intermediate = double_width // 2
    top_k = topk_ids.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    config = choose_config(num_tokens, hidden, intermediate, top_k, local_experts)
    block_m = config.block_m
    num_pairs = num_tokens * top_k
    sorted_pairs, block_expert, num_blocks = moe_route(
        topk_ids, local_experts, first_expert, block_m, config.one_program_routing
    )
    blocks = block_expert.shape[0]
    device = x.device

    mid = torch.empty((blocks * block_m, intermediate), dtype=x.dtype, device=device)
    tile = config.gate_up
    block_k, per_row = _step_k(tile.block_k, gate_up)
    if not per_row and block_m >= 64:  # each scaled step's two partial products need the registers
        tile = dataclasses.replace(tile, num_warps=8)  # 4 warps spilled on sm_89 / sm_90 (variants.py)
    data, scale = gate_up.data, gate_up.scale
    args = (x, data, scale, mid, sorted_pairs, block_expert, num_blocks, num_pairs, top_k, hidden)
    args += (
        intermediate,
        x.stride(0),
        data.stride(0),
        data.stride(1),
        scale.stride(0),
        scale.stride(1),
        mid.stride(0),
    )
    constexprs = {
        "ACTIVATION": ACTIVATIONS[activation],
        "GROUP_K": gate_up.group_k,
        "PER_ROW": per_row,
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": block_k,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (blocks * cdiv(intermediate, tile.block_n),)
    _launch(_moe_fp8_gate_up_kernel, grid, args, constexprs, device, tile.num_warps)

    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    tile = config.down
    block_k, per_row = _step_k(tile.block_k, down)
    data, scale = down.data, down.scale
    args = (mid, data, scale, topk_weights, per_pair, sorted_pairs, block_expert, num_blocks, num_pairs)
    args += (hidden, intermediate, mid.stride(0), data.stride(0), data.stride(1), scale.stride(0))
    args += (scale.stride(1), per_pair.stride(0))
    constexprs = {
        "GROUP_K": down.group_k,
        "PER_ROW": per_row,
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": block_k,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (blocks * cdiv(hidden, tile.block_n),)
    _launch(_moe_fp8_down_kernel, grid, args, constexprs, device, tile.num_warps)
    return sum_pair_rows(per_pair, topk_ids, out, first_expert, local_experts)
