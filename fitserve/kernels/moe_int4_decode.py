"""A mixture-of-experts layer over int4 experts for decode-sized batches, in two kernels: moe_decode.py's
plan (no routing, no sum kernel) on fused_moe_int4.py's weights, with the multiply-adds on the CUDA cores.

At batch 1 the grouped int4 path (fused_moe_int4.py) runs four kernels a layer (routing, gate_up, down,
sum), and its tensor-core tiles do little useful work at one token (each dequantized tile goes through
shared memory into the MMA's operand layout, and 15 of the tile's 16 rows are padding). One token's row
needs no tensor core: each program keeps a [BLOCK_N, 32] float32 accumulator, and a weight costs a shift,
a mask (OR-ed under a float exponent, so no conversion instruction), two subtractions, the scale and one
FMA with x; the 32 columns are summed once. Measured on an H200 at Qwen3-30B-A3B's experts
(benchmarks/results/h200_moe_int4_decode.json): 22.2 us a layer at one token (19 MB of words and scales,
0.21 of the copy bandwidth) against the grouped path's 37.4 us.

1. `_int4_decode_gate_up_kernel`: one program per (token, slot, BLOCK_N intermediate columns). It finds the
   slot's expert in topk_ids, reads the expert's gate and up words (per 256-code block [BLOCK_N, 32]
   words, each holding 8 nibbles of 32 consecutive columns) and stores act(gate) * up to `mid` [T * k, I].
2. `_int4_decode_down_kernel`: one program per (token, BLOCK_N hidden columns, split of the token's slots)
   runs through its slots' down words, weights each slot's row, rounds it and sums the slots in float32;
   split slots are added by moe_decode.sum_split_partials.
The loops over K are unrolled (the block count is a constexpr: one compile per model shape), so ptxas
issues every block's loads before the first multiply-add: with a tl.range loop over the blocks (Triton's
pipelining, 2 to 4 stages) the same kernels ran at 0.14-0.15 of the copy bandwidth whatever their tiles.

Numbers: each weight (code - zero) * scale in float32 (the grouped path rounds it to the activation dtype
first; both are within that rounding of the dequantized reference), products summed in float32; then as
the grouped path: act(gate) * up rounded once, each weighted row rounded, a token's rows summed in float32
in slot order and rounded. Expert parallel: a slot whose expert another rank holds adds nothing and its
weights are never read. No host sync and launches that depend only on the shapes, so CUDA graphs capture
it for any routing.

Reference: layers/moe_int4.py Int4FusedExperts.reference (tests/unit/test_fused_moe_int4_interpret.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import sm_count
from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.grid_math import cdiv, next_power_of_2
from fitserve.kernels.int4_repack import BLOCK_K, WORDS_PER_BLOCK
from fitserve.kernels.moe_decode import (
    COUNTER_SLOTS,
    down_splits,
    slot_expert,
    slot_of,
    sum_split_partials,
    token_slots,
)
from fitserve.kernels.moe_parts import ACTIVATIONS
from fitserve.kernels.moe_parts import activation as _activation
from fitserve.kernels.moe_parts import host_launched as _host_launched
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.split_counters import device_counters

if TYPE_CHECKING:
    from fitserve.kernels.fused_moe_int4 import PackedExperts

# Tokens up to which fused_moe_int4 takes this path (0 turns it off): past them the grouped path's one read
# of each chosen expert per tile of rows wins. Measured on an H200 at Qwen3-30B-A3B's experts
# (benchmarks/results/h200_moe_int4_decode.json): 22.2 against 37.4 us at 1 token, 62.1 against 76.9 at 4,
# even at 8 (117.4 both).
MAX_TOKENS = 4


def takes(num_tokens: int) -> bool:
    """Whether a step of this many tokens runs here rather than on fused_moe_int4's grouped path."""
    return 0 < num_tokens <= MAX_TOKENS


@dataclass(frozen=True)
class Int4DecodeConfig:
    gate_up_block_n: int = 32
    down_block_n: int = 64
    num_warps: int = 8
    # programs the down kernel aims for per SM (moe_decode.down_splits); slots per split forced: tests
    down_programs_per_sm: int = 3
    down_slots_per_split: int | None = None


# The best of benchmarks/gpu/moe_int4_decode_bench.py --sweep on an H200 at 1, 4 and 8 tokens alike.
DEFAULT_CONFIG = Int4DecodeConfig()


@triton.jit
def group_of(block, J: tl.constexpr, GROUP: tl.constexpr):
    """The quantization group of nibble J's 32 codes in 256-code block `block`."""
    return (block * 256 + J * 32) // GROUP


@triton.jit
def _scale_zero(sz_rows, n_ok):
    """The rows' (scale, zero point) of one group, float32 [BLOCK_N] each."""
    scale = tl.load(sz_rows, mask=n_ok, other=0.0).to(tl.float32)
    zero = tl.load(sz_rows + 1, mask=n_ok, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def _weights_times_x(acc, words, scale, zero, x_chunk, J: tl.constexpr):
    """acc [BLOCK_N, 32] + the weights of nibble J of `words` [BLOCK_N, 32] times x_chunk [32] (their 32
    columns of x), in float32 on the CUDA cores: (code - zero) * scale, exact up to the float32 product."""
    # the code as a float without a conversion instruction (a quarter-rate one on Hopper): OR-ed under the
    # exponent of 2**23 the int32 is the float 2**23 + code, and subtracting 2**23 is exact
    codes = (((words >> (4 * J)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return acc + ((codes - zero[:, None]) * scale[:, None]) * x_chunk[None, :]


@_host_launched
@triton.jit
def _int4_decode_gate_up_kernel(
    x_ptr,
    qw_ptr,
    sz_ptr,
    mid_ptr,
    topk_ids_ptr,
    hidden,
    intermediate,
    first_expert,
    local_experts,
    stride_xm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_mm,
    TOP_K: tl.constexpr,
    GROUP: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCKS: tl.constexpr,  # 256-code blocks of hidden
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(1)  # token * TOP_K + slot
    token = row // TOP_K
    slot = row % TOP_K
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < intermediate
    wait_for_previous_kernel(USE_PDL)
    expert, mine = slot_expert(topk_ids_ptr, token, slot, first_expert, local_experts, TOP_K)
    if mine:
        rows64 = offs_n.to(tl.int64)
        gate_words = qw_ptr + expert * stride_qe + rows64[:, None] * stride_qn
        up_words = gate_words + intermediate * stride_qn
        gate_sz = sz_ptr + expert * stride_se + rows64 * 2
        up_sz = gate_sz + intermediate * 2
        offs_w = tl.arange(0, 32)
        x_row = x_ptr + token.to(tl.int64) * stride_xm
        gate = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
        for b in tl.static_range(BLOCKS):  # unrolled: every block's loads can be in flight at once
            w_gate = tl.load(gate_words + (b * 32 + offs_w)[None, :], mask=n_ok[:, None], other=0)
            w_up = tl.load(up_words + (b * 32 + offs_w)[None, :], mask=n_ok[:, None], other=0)
            for j in tl.static_range(8):
                if (j * 32) % GROUP == 0 or j == 0:  # a group starts: its scales (compile-time test)
                    group = group_of(b, j, GROUP)
                    gate_scale, gate_zero = _scale_zero(gate_sz + group * stride_sg, n_ok)
                    up_scale, up_zero = _scale_zero(up_sz + group * stride_sg, n_ok)
                k = b * 256 + j * 32 + offs_w
                x_chunk = tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)
                gate = _weights_times_x(gate, w_gate, gate_scale, gate_zero, x_chunk, j)
                up = _weights_times_x(up, w_up, up_scale, up_zero, x_chunk, j)
        mid = _activation(tl.sum(gate, axis=1), ACTIVATION) * tl.sum(up, axis=1)
        tl.store(mid_ptr + row.to(tl.int64) * stride_mm + offs_n, mid.to(mid_ptr.dtype.element_ty), mask=n_ok)


@_host_launched
@triton.jit(do_not_specialize=["num_splits", "slots_per_split"])
def _int4_decode_down_kernel(
    mid_ptr,
    qw_ptr,
    sz_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    num_tokens,
    hidden,
    intermediate,
    first_expert,
    local_experts,
    num_splits,
    slots_per_split,
    stride_mm,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sg,
    stride_om,
    TOP_K: tl.constexpr,
    TOP_K_POW2: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCKS: tl.constexpr,  # 256-code blocks of the intermediate width
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    rows64 = offs_n.to(tl.int64)
    offs_w = tl.arange(0, 32)
    dtype = out_ptr.dtype.element_ty
    wait_for_previous_kernel(USE_PDL)
    experts, mine_of_slot, weights = token_slots(
        topk_ids_ptr, topk_weights_ptr, token, first_expert, local_experts, TOP_K, TOP_K_POW2
    )
    routed = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(split * slots_per_split, tl.minimum((split + 1) * slots_per_split, TOP_K)):
        expert, mine, weight = slot_of(experts, mine_of_slot, weights, slot)
        words = qw_ptr + expert * stride_qe + rows64[:, None] * stride_qn + offs_w[None, :]
        sz_rows = sz_ptr + expert * stride_se + rows64 * 2
        mid_row = mid_ptr + (token * TOP_K + slot).to(tl.int64) * stride_mm
        acc = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
        for b in tl.static_range(BLOCKS):  # unrolled: every block's loads can be in flight at once
            w = tl.load(words + b * 32, mask=n_ok[:, None] & mine, other=0)  # another rank's: never read
            for j in tl.static_range(8):
                if (j * 32) % GROUP == 0 or j == 0:  # a group starts: its scales (compile-time test)
                    scale, zero = _scale_zero(sz_rows + group_of(b, j, GROUP) * stride_sg, n_ok & mine)
                k = b * 256 + j * 32 + offs_w
                a = tl.load(mid_row + k, mask=(k < intermediate) & mine, other=0.0).to(tl.float32)
                acc = _weights_times_x(acc, w, scale, zero, a, j)
        routed += (tl.sum(acc, axis=1) * weight).to(dtype).to(tl.float32)  # each slot's row rounded
    finish, routed, _ = sum_split_partials(
        routed, tl.zeros_like(routed), part_ptr, counter_ptr, token, pid_n, offs_n, hidden, num_tokens,
        split, num_splits,
    )  # fmt: skip
    if finish:
        tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, routed.to(dtype), mask=n_ok)


def moe_int4_decode(
    x: torch.Tensor,
    gate_up: PackedExperts,
    down: PackedExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
    config: Int4DecodeConfig | None = None,
) -> torch.Tensor:
    """fused_moe_int4's result (this rank's share of the MoE output [T, hidden] in x's dtype) in two
    kernels. gate_up / down are fused_moe_int4.PackedExperts; fused_moe_int4.check_inputs has checked the
    inputs, x is contiguous along hidden, topk_ids contiguous and topk_weights float32 contiguous."""
    config = config or DEFAULT_CONFIG
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    local_experts = gate_up.num_experts
    intermediate = gate_up.out_features // 2
    device = x.device
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out

    mid = torch.empty((num_tokens * top_k, intermediate), dtype=x.dtype, device=device)
    qw, sz = gate_up.qweight, gate_up.scale_zero
    args = (x, qw, sz, mid, topk_ids, hidden, intermediate, first_expert, local_experts, x.stride(0))
    args += (qw.stride(0), qw.stride(1), sz.stride(0), sz.stride(1), mid.stride(0))
    constexprs = {
        "TOP_K": top_k,
        "GROUP": gate_up.group_size,
        "ACTIVATION": ACTIVATIONS[activation],
        "BLOCKS": cdiv(hidden, BLOCK_K),
        "BLOCK_N": config.gate_up_block_n,
    }
    grid = (cdiv(intermediate, config.gate_up_block_n), num_tokens * top_k)
    _launch(_int4_decode_gate_up_kernel, grid, args, constexprs, device, config.num_warps)

    tiles = cdiv(hidden, config.down_block_n)
    splits, per_split = down_splits(tiles, num_tokens, top_k, sm_count(device), config.down_programs_per_sm)
    if config.down_slots_per_split is not None:
        per_split = min(config.down_slots_per_split, top_k)
        splits = cdiv(top_k, per_split)
    part_shape = (splits, 2, num_tokens, hidden) if splits > 1 else (1,)
    parts = torch.empty(part_shape, dtype=torch.float32, device=device)
    counters = device_counters("moe_int4_decode", device, COUNTER_SLOTS)
    qw, sz = down.qweight, down.scale_zero
    args = (mid, qw, sz, topk_ids, topk_weights, out, parts, counters, num_tokens, hidden, intermediate)
    args += (first_expert, local_experts, splits, per_split, mid.stride(0), qw.stride(0), qw.stride(1))
    args += (sz.stride(0), sz.stride(1), out.stride(0))
    constexprs = {
        "TOP_K": top_k,
        "TOP_K_POW2": next_power_of_2(top_k),
        "GROUP": down.group_size,
        "BLOCKS": cdiv(intermediate, BLOCK_K),
        "BLOCK_N": config.down_block_n,
    }
    _launch(_int4_decode_down_kernel, (tiles, num_tokens, splits), args, constexprs, device, config.num_warps)
    return out


# the layout constants the kernels above are written for
assert BLOCK_K == 256 and WORDS_PER_BLOCK == 32
