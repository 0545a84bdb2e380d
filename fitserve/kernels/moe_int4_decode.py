"""A mixture-of-experts layer over int4 experts for decode-sized batches, in two kernels: moe_decode.py's
plan (no routing, no sum kernel) on fused_moe_int4.py's weights, with the multiply-adds on the CUDA cores.

At batch 1 the grouped int4 path (fused_moe_int4.py) runs four kernels a layer (routing, gate_up, down,
sum), and its tensor-core tiles do little useful work at one token (each dequantized tile goes through
shared memory into the MMA's operand layout, and 15 of the tile's 16 rows are padding). One token's row
needs no tensor core: each program keeps [BLOCK_N, 32] float32 accumulators, and a weight costs two
instructions, a byte permute and an FMA (~4.5 a weight in all in the sm_90 SASS, against ~8 with a shift,
mask, two subtractions and the scale per weight):
- each loaded word is split once into its even and odd nibbles, each in the low half of a byte (two LOP3s
  and a shift per 8 codes);
- PRMT moves one code's byte under the exponent of 0.5 (bits 16..23 of 0x3F000000): the float
  0.5 + code / 256, exact, with no conversion instruction;
- an FMA adds it times x to a per-group partial sum; where a group's run of codes ends the partial goes
  into the accumulator with the group's scale and zero point, as
  scale * (256 * partial - (128 + zero) * sum of x): two FMAs per element per group.
Measured on an H200 at Qwen3-30B-A3B's experts (benchmarks/results/h200_moe_int4_decode.json, "prmt"):
14.9 us a layer at one token (19 MB of words and scales, 0.32 of the copy bandwidth; 22.2 us before the
permute, 37.5 on the grouped path).

1. `_int4_decode_gate_up_kernel`: one program per (token, slot, BLOCK_N intermediate columns). It finds the
   slot's expert in topk_ids, reads the expert's gate and up words (per 256-code block [BLOCK_N, 32]
   words, each holding 8 nibbles of 32 consecutive columns) and stores act(gate) * up to `mid` [T * k, I].
2. `_int4_decode_down_kernel`: one program per (token, BLOCK_N hidden columns, split of the token's slots)
   runs through its slots' down words, weights each slot's row, rounds it and sums the slots in float32;
   split slots are added by moe_decode.sum_split_partials.
The loops over K are unrolled (the block count is a constexpr: one compile per model shape), so ptxas
issues every block's loads before the first multiply-add: with a tl.range loop over the blocks (Triton's
pipelining, 2 to 4 stages) the same kernels ran at 0.14-0.15 of the copy bandwidth whatever their tiles.

Numbers: (0.5 + code / 256) * x summed in float32 per group run, then scaled (the grouped path rounds each
weight to the activation dtype first; both are within that rounding of the dequantized reference); then as
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
from fitserve.kernels.fast_launch import INTERPRETING, host_launched
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
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.split_counters import device_counters

if TYPE_CHECKING:
    from fitserve.kernels.fused_moe_int4 import PackedExperts

# Tokens up to which fused_moe_int4 takes this path (0 turns it off): past them the grouped path's one read
# of each chosen expert per tile of rows wins. Measured on an H200 at Qwen3-30B-A3B's experts
# (benchmarks/results/h200_moe_int4_decode.json, "prmt"): 14.9 against 37.5 us at 1 token, 42.2 against 77.0
# at 4, 76.9 against 117.5 at 8.
MAX_TOKENS = 8


def takes(num_tokens: int) -> bool:
    """Whether a step of this many tokens runs here rather than on fused_moe_int4's grouped path."""
    return 0 < num_tokens <= MAX_TOKENS


@dataclass(frozen=True)
class Int4DecodeConfig:
    gate_up_block_n: int = 32
    down_block_n: int = 32
    num_warps: int = 4
    # programs the down kernel aims for per SM (moe_decode.down_splits); slots per split forced: tests
    down_programs_per_sm: int = 3
    down_slots_per_split: int | None = None


# The best of benchmarks/gpu/moe_int4_decode_bench.py --sweep on an H200: at 1 token narrow gate_up tiles
# (twice the programs: 14.9 us, against 18.5 for the best 32-wide), at 4 and 8 tokens 32-wide ones (42.2
# and 76.9 us, against 45.9 and 80.5 with the single-token tiles; 2 tokens not measured).
SINGLE_TOKEN_CONFIG = Int4DecodeConfig(gate_up_block_n=16, down_block_n=64)
DEFAULT_CONFIG = Int4DecodeConfig()


def config_for(num_tokens: int) -> Int4DecodeConfig:
    """The measured tiles for a step of `num_tokens` tokens."""
    return SINGLE_TOKEN_CONFIG if num_tokens == 1 else DEFAULT_CONFIG


@triton.jit
def group_of(block, J: tl.constexpr, GROUP: tl.constexpr):
    """The quantization group of nibble J's 32 codes in 256-code block `block`."""
    return (block * 256 + J * 32) // GROUP


@triton.jit
def nibble_bytes(words):
    """(even, odd): the words' nibbles 0, 2, 4, 6 and 1, 3, 5, 7 each in the low half of its own byte."""
    return words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F


@triton.jit
def half_plus_code_256ths(even, odd, J: tl.constexpr, PRMT: tl.constexpr):
    """0.5 + code / 256 in float32 for nibble J of the words whose nibble_bytes are (even, odd): the code's
    byte goes to bits 16..23 under the exponent of 0.5 (0x3F000000), one PRMT on GPUs (the selector takes
    bytes 3, 1, 0 of the constant and byte J // 2 of the codes), a shift and an OR in the interpreter."""
    codes = even if J % 2 == 0 else odd
    if PRMT:
        bits = tl.inline_asm_elementwise(
            asm=f"prmt.b32 $0, $1, $2, {0x3410 + 0x100 * (J // 2)};",
            constraints="=r,r,r",
            args=[tl.full(codes.shape, 0x3F000000, tl.int32), codes],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        bits = ((codes >> (8 * (J // 2))) & 15) << 16 | 0x3F000000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fold_segment(acc, part, x_sum, sz_rows, n_ok):
    """acc [BLOCK_N, 32] + one group's run of codes: part holds sum (0.5 + code/256) * x per element and
    x_sum the run's x per column, so sum (code - zero) * scale * x is
    scale * (256 part - (128 + zero) x_sum)."""
    scale = tl.load(sz_rows, mask=n_ok, other=0.0).to(tl.float32)
    zero = tl.load(sz_rows + 1, mask=n_ok, other=0.0).to(tl.float32)
    acc += (256.0 * scale)[:, None] * part
    return acc - (scale * (128.0 + zero))[:, None] * x_sum[None, :]


@host_launched
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
    PRMT: tl.constexpr,  # PTX's byte permute (GPUs) or plain integer operations (the interpreter)
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
            gate_even, gate_odd = nibble_bytes(w_gate)
            up_even, up_odd = nibble_bytes(w_up)
            for j in tl.static_range(8):
                if (b * 256 + j * 32) % GROUP == 0 or j == 0:  # a run of one group starts (compile time)
                    gate_part = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
                    up_part = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
                    x_sum = tl.zeros((32,), dtype=tl.float32)
                k = b * 256 + j * 32 + offs_w
                x_chunk = tl.load(x_row + k, mask=k < hidden, other=0.0).to(tl.float32)
                gate_part += half_plus_code_256ths(gate_even, gate_odd, j, PRMT) * x_chunk[None, :]
                up_part += half_plus_code_256ths(up_even, up_odd, j, PRMT) * x_chunk[None, :]
                x_sum += x_chunk
                if (b * 256 + j * 32 + 32) % GROUP == 0 or j == 7:  # and ends here
                    group = group_of(b, j, GROUP) * stride_sg
                    gate = _fold_segment(gate, gate_part, x_sum, gate_sz + group, n_ok)
                    up = _fold_segment(up, up_part, x_sum, up_sz + group, n_ok)
        mid = _activation(tl.sum(gate, axis=1), ACTIVATION) * tl.sum(up, axis=1)
        tl.store(mid_ptr + row.to(tl.int64) * stride_mm + offs_n, mid.to(mid_ptr.dtype.element_ty), mask=n_ok)


@host_launched
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
    PRMT: tl.constexpr,  # PTX's byte permute (GPUs) or plain integer operations (the interpreter)
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
            even, odd = nibble_bytes(w)
            for j in tl.static_range(8):
                if (b * 256 + j * 32) % GROUP == 0 or j == 0:  # a run of one group starts (compile time)
                    part = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
                    a_sum = tl.zeros((32,), dtype=tl.float32)
                k = b * 256 + j * 32 + offs_w
                a = tl.load(mid_row + k, mask=(k < intermediate) & mine, other=0.0).to(tl.float32)
                part += half_plus_code_256ths(even, odd, j, PRMT) * a[None, :]
                a_sum += a
                if (b * 256 + j * 32 + 32) % GROUP == 0 or j == 7:  # and ends here
                    group = group_of(b, j, GROUP) * stride_sg
                    acc = _fold_segment(acc, part, a_sum, sz_rows + group, n_ok & mine)
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
    num_tokens, hidden = x.shape
    config = config or config_for(num_tokens)
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
        "PRMT": not INTERPRETING,
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
        "PRMT": not INTERPRETING,
    }
    _launch(_int4_decode_down_kernel, (tiles, num_tokens, splits), args, constexprs, device, config.num_warps)
    return out


# the layout constants the kernels above are written for
assert BLOCK_K == 256 and WORDS_PER_BLOCK == 32
