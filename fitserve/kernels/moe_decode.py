"""A mixture-of-experts layer for decode-sized batches in two kernels, the shared expert included.

fused_moe.py's grouped path sorts the (token, slot) pairs by expert so that a tile of rows shares one
expert's weights: worth it when many tokens choose the same experts, pure overhead when a step has a
handful of tokens. At batch 1 the layer is its k experts' weights streamed once, and every launch between
them costs a few microseconds: the grouped path takes four (routing, gate_up, down, sum), and Qwen3.5/3.6's
shared expert four more beside it (two cuBLAS GEMMs, the activation, the gate and sum kernel). Here:

1. `_decode_gate_up_kernel`: one program per (token, slot, BLOCK_N intermediate columns); a slot is one of
   the token's k routed experts or, when given, the shared expert (slot k). It streams the expert's gate
   and up rows once, multiplies them by the token's row (x padded to a 16-row tensor-core tile, as
   skinny_gemm.py does) and stores act(gate) * up to `mid` [T * slots, I].
2. `_decode_down_kernel`: one program per (token, BLOCK_N hidden columns, split of the token's slots) runs
   through its slots' down rows in one pipelined loop (slots x K chunks), so a program streams several
   experts' slices back to back rather than one short loop each; it weights each routed slot's result,
   rounds it to the dtype and sums them in float32 (the grouped path's and the torch path's rounding). With
   the slots split (`down_splits`: at batch 1 a tile's slots alone make too few programs to keep the memory
   busy) each program stores its float32 partial rows and the last to arrive at the tile's counter adds
   them in split order (the same sum whoever arrives last) and resets the counter, so replays need no
   memset. The program that finishes a tile adds the gated shared expert.

Numbers: routed slots as the grouped kernels compute them (act(gate) * up in float32, rounded once; each
weighted row rounded, the k rows summed in float32 and rounded). The shared expert as Qwen3.5's torch
modules round it (gate and up rounded, silu rounded, their product rounded, the down projection rounded),
its gate as kernels/shared_expert_gate.py computes it (the same one-block dot product, torch's sigmoid
rounded), and the end as that kernel does: round(routed + round(gate * shared)).

fp8 experts (layers/moe_fp8.py sends one token here): the same two kernels stream the e4m3 weights and
scale each BLOCK_K step by its float32 scales (moe_parts.scaled_step, W8A16), without a shared expert.

Expert parallel: a slot whose expert another rank holds contributes nothing (its loads are masked off, so
its weights are never read). Tensor parallel: I is this rank's slice, for the routed and shared experts
alike (the caller checks that the two widths match). Nothing syncs with the host and the launches depend
only on the shapes, so CUDA graphs capture it for any routing.

Reference: FusedExperts.reference (fitserve/layers/moe.py) plus the shared expert of
models/qwen3_5_layers.Qwen3_5SparseMoeBlock's torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.activation import exp_as_torch
from fitserve.kernels.capability import sm_count
from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.fp8_bits import e4m3_as_stored
from fitserve.kernels.grid_math import cdiv, next_power_of_2
from fitserve.kernels.moe_parts import ACTIVATIONS, Fp8Experts, GemmTile, scaled_step
from fitserve.kernels.moe_parts import activation as _activation
from fitserve.kernels.moe_parts import dot as _dot
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.split_counters import device_counters

# Rows of the tensor-core tile a token's row is padded to.
TILE_ROWS = 16
# Tokens up to which fused_moe takes this path (0 turns it off), without and with a shared expert. Past
# them the grouped path's one read of each chosen expert per tile of rows wins: tokens share experts, and
# this path reads an expert once per (token, slot). Measured on an H100 (benchmarks/gpu/moe_decode_bench.py,
# docs/performance.md "MoE decode"): routed experts alone, 1.18x the grouped path at 1 token, even at 2,
# 0.95x at 4; with Qwen3.6's shared expert (which the grouped path runs as four more launches) 1.43x at 1,
# 1.26-1.29x at 2-4, 1.03x at 8, 0.83x at 16.
MAX_TOKENS = 1
MAX_TOKENS_WITH_SHARED = 8


def takes(num_tokens: int, with_shared: bool = False) -> bool:
    """Whether a step of this many tokens runs here rather than on fused_moe's grouped path."""
    return 0 < num_tokens <= (MAX_TOKENS_WITH_SHARED if with_shared else MAX_TOKENS)


@dataclass(frozen=True)
class MoeDecodeConfig:
    gate_up: GemmTile
    down: GemmTile
    # programs the down kernel aims for per SM: where its (token, tile) programs are fewer, each token's
    # slots are split over several programs (`down_splits`)
    down_programs_per_sm: int = 3
    # slots per split, forced (tests and sweeps); None: down_splits decides
    down_slots_per_split: int | None = None


# From benchmarks/gpu/moe_decode_bench.py --sweep on an H100 (docs/performance.md, "MoE decode").
DEFAULT_CONFIG = MoeDecodeConfig(GemmTile(32, 128, 4, 4), GemmTile(32, 128, 4, 4))
# (token, hidden tile) counters: enough for 16 tokens at hidden 16,384 in 16-wide tiles; splits happen only
# below down_programs_per_sm x SMs programs anyway.
COUNTER_SLOTS = 16384


def down_splits(tiles: int, tokens: int, slots: int, sms: int, programs_per_sm: int) -> tuple[int, int]:
    """(splits, slots per split) of each token's slots over the down kernel's programs: as many splits as
    bring tiles x tokens x splits nearest programs_per_sm x sms, at most one per slot, none empty."""
    wanted = round(programs_per_sm * sms / (tiles * tokens))
    if wanted <= 1 or tiles * tokens > COUNTER_SLOTS:
        return 1, slots
    per_split = cdiv(slots, min(wanted, slots))
    return cdiv(slots, per_split), per_split


@dataclass(frozen=True)
class SharedExpert:
    """Qwen3.5/3.6's shared expert, this rank's slices: gate_up_proj [2 I, hidden] (gate rows, then up
    rows), down_proj [hidden, I], gate_weight [1, hidden] (the one-output gate projection)."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_weight: torch.Tensor


@triton.jit
def slot_expert(topk_ids_ptr, token, slot, first_expert, local_experts, TOP_K: tl.constexpr):
    """This rank's index of the expert in the token's routed slot (0 when the slot is another rank's or
    the shared one), and whether this rank computes the slot."""
    routed = slot < TOP_K
    pair = token * TOP_K + tl.minimum(slot, TOP_K - 1)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32) - first_expert
    mine = (expert >= 0) & (expert < local_experts)
    return tl.where(routed & mine, expert, 0).to(tl.int64), mine | (slot >= TOP_K)


@host_launched
@triton.jit
def _decode_gate_up_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    shared_w_ptr,
    mid_ptr,
    topk_ids_ptr,
    hidden,
    intermediate,
    first_expert,
    local_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_sn,
    stride_mm,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FP32: tl.constexpr,
    W_FP8: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(1)  # token * SLOTS + slot
    token = row // SLOTS
    slot = row % SLOTS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < intermediate
    wait_for_previous_kernel(USE_PDL)
    expert, mine = slot_expert(topk_ids_ptr, token, slot, first_expert, local_experts, TOP_K)
    if mine:
        shared = slot >= TOP_K
        rows64 = offs_n.to(tl.int64)[:, None]
        gate_rows = tl.where(
            shared, shared_w_ptr + rows64 * stride_sn, w_ptr + expert * stride_we + rows64 * stride_wn
        )
        up_rows = gate_rows + intermediate * tl.where(shared, stride_sn, stride_wn)
        gate_scales = w_scale_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn  # W_FP8 only
        up_scales = gate_scales + intermediate * stride_wsn
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        x_row = x_ptr + token.to(tl.int64) * stride_xm + 0 * offs_m[:, None]  # one real row of the tile
        first_row = (offs_m == 0)[:, None]
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = (k + offs_k) < hidden
            a = tl.load(x_row + (k + offs_k)[None, :], mask=first_row & k_ok[None, :], other=0.0)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w_gate = tl.load(gate_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
            w_up = tl.load(up_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
            if W_FP8:  # e4m3 rows and their scales (no shared slot: the launcher refuses one)
                gate = scaled_step(gate, a, a, w_gate, gate_scales, k, GROUP_K, False, False, n_ok)
                up = scaled_step(up, a, a, w_up, up_scales, k, GROUP_K, False, False, n_ok)
            else:
                gate = _dot(a, tl.trans(w_gate), gate, FP32)
                up = _dot(a, tl.trans(w_up), up, FP32)
        gate = tl.sum(gate, axis=0)  # the padding rows are zeros
        up = tl.sum(up, axis=0)
        dtype = mid_ptr.dtype.element_ty
        if shared:  # as Qwen3.5's modules round: the projections, silu, the product
            gate = gate.to(dtype).to(tl.float32)
            silu = tl.div_rn(gate, 1.0 + exp_as_torch(-gate)).to(dtype).to(tl.float32)
            mid = silu * up.to(dtype).to(tl.float32)
        else:
            mid = _activation(gate, ACTIVATION) * up
        tl.store(mid_ptr + row.to(tl.int64) * stride_mm + offs_n, mid.to(dtype), mask=n_ok)


@triton.jit
def _down_epilogue(
    routed,
    shared,
    x_ptr,
    shared_gate_ptr,
    out_ptr,
    token,
    offs_n,
    hidden,
    stride_xm,
    stride_om,
    HAS_SHARED: tl.constexpr,
    GATE_BLOCK: tl.constexpr,
):
    """out[token, offs_n] = round(routed) (the float32 sum of the rounded weighted slots), plus the gated
    shared expert (its down projection's float32 row `shared`) as kernels/shared_expert_gate.py adds it."""
    dtype = out_ptr.dtype.element_ty
    out = routed.to(dtype)
    if HAS_SHARED:
        cols = tl.arange(0, GATE_BLOCK)
        col_ok = cols < hidden
        x = tl.load(x_ptr + token.to(tl.int64) * stride_xm + cols, mask=col_ok, other=0.0).to(tl.float32)
        gate_weight = tl.load(shared_gate_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        logit = tl.sum(x * gate_weight, axis=0).to(dtype).to(tl.float32)
        gate = tl.div_rn(1.0, 1.0 + exp_as_torch(-logit)).to(dtype).to(tl.float32)  # torch.sigmoid's numbers
        gated = (gate * shared.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        out = (out.to(tl.float32) + gated).to(dtype)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n, out, mask=offs_n < hidden)


@triton.jit
def token_slots(topk_ids_ptr, topk_weights_ptr, token, first_expert, local_experts, TOP_K: tl.constexpr,
                SLOTS_POW2: tl.constexpr):  # fmt: skip
    """A token's slots read once, before a loop over them (a load in the loop would stop Triton pipelining
    its weight streams): for each of SLOTS_POW2 slots, this rank's index of its expert (0 for the shared
    slot, TOP_K, and another rank's), whether this rank computes it, and its routing weight."""
    slots = tl.arange(0, SLOTS_POW2)
    pairs = token * TOP_K + tl.minimum(slots, TOP_K - 1)
    experts = tl.load(topk_ids_ptr + pairs).to(tl.int32) - first_expert
    mine = ((experts >= 0) & (experts < local_experts) & (slots < TOP_K)) | (slots == TOP_K)
    experts = tl.where(mine & (slots < TOP_K), experts, 0)
    return experts, mine, tl.load(topk_weights_ptr + pairs)


@triton.jit
def slot_of(experts, mine_of_slot, weights, slot):
    """(expert index, whether this rank computes it, routing weight) of `slot` in token_slots' tables."""
    this_slot = tl.arange(0, experts.shape[0]) == slot
    expert = tl.sum(tl.where(this_slot, experts, 0), axis=0).to(tl.int64)
    mine = tl.sum(tl.where(this_slot & mine_of_slot, 1, 0), axis=0) > 0
    return expert, mine, tl.sum(tl.where(this_slot, weights, 0.0), axis=0)


@triton.jit
def sum_split_partials(routed, shared, part_ptr, counter_ptr, token, pid_n, offs_n, hidden, num_tokens, split,
                       num_splits):  # fmt: skip
    """(whether this program finishes the (token, tile), the routed and shared rows it finishes with). One
    split: its own rows. Several: each split's two partial rows go to part [split, 2, T, hidden] (float32)
    and the program that arrives last at the (token, tile) counter adds them in split order (the same sum
    whoever arrives last), then resets the counter for the next call."""
    n_ok = offs_n < hidden
    finish = num_splits == 1
    if num_splits > 1:
        part = part_ptr + token.to(tl.int64) * hidden + offs_n
        split_stride = 2 * num_tokens * hidden
        tl.store(part + split * split_stride, routed, mask=n_ok)
        tl.store(part + split * split_stride + num_tokens * hidden, shared, mask=n_ok)
        tl.debug_barrier()  # every thread's partials are written before the release below
        counter = counter_ptr + token * tl.num_programs(0) + pid_n
        finish = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1
        if finish:
            routed = tl.zeros_like(routed)
            shared = tl.zeros_like(shared)
            for other in range(0, num_splits):
                routed += tl.load(part + other * split_stride, mask=n_ok, other=0.0, cache_modifier=".cg")
                own = part + other * split_stride + num_tokens * hidden
                shared += tl.load(own, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
    return finish, routed, shared


@host_launched
@triton.jit(do_not_specialize=["num_splits", "slots_per_split"])
def _decode_down_kernel(
    mid_ptr,
    w_ptr,
    w_scale_ptr,
    shared_w_ptr,
    x_ptr,
    shared_gate_ptr,
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
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_sn,
    stride_xm,
    stride_om,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
    FP32: tl.constexpr,
    W_FP8: tl.constexpr,
    GROUP_K: tl.constexpr,
    GATE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    rows64 = offs_n.to(tl.int64)[:, None]
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    first_row = (offs_m == 0)[:, None]
    dtype = out_ptr.dtype.element_ty
    wait_for_previous_kernel(USE_PDL)
    chunks = tl.cdiv(intermediate, BLOCK_K)
    experts, mine_of_slot, weights = token_slots(
        topk_ids_ptr, topk_weights_ptr, token, first_expert, local_experts, TOP_K, SLOTS_POW2
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    routed = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    shared = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # this split's slots in one loop over their K chunks: the pipeline runs on from one expert's rows into
    # the next's
    first_slot = split * slots_per_split
    steps = (tl.minimum(first_slot + slots_per_split, SLOTS) - first_slot) * chunks
    for step in tl.range(0, steps, num_stages=NUM_STAGES):
        slot = first_slot + step // chunks
        k = (step % chunks) * BLOCK_K
        expert, mine, weight = slot_of(experts, mine_of_slot, weights, slot)
        is_shared = slot >= TOP_K
        w_rows = tl.where(
            is_shared, shared_w_ptr + rows64 * stride_sn, w_ptr + expert * stride_we + rows64 * stride_wn
        )
        k_ok = (k + offs_k) < intermediate
        mid_row = mid_ptr + (token * SLOTS + slot).to(tl.int64) * stride_mm + 0 * offs_m[:, None]
        a = tl.load(mid_row + (k + offs_k)[None, :], mask=first_row & k_ok[None, :] & mine, other=0.0)
        w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :] & mine, other=0.0)
        if W_FP8:
            w_scales = w_scale_ptr + expert * stride_wse + offs_n.to(tl.int64) * stride_wsn
            acc = scaled_step(acc, a, a, w, w_scales, k, GROUP_K, False, False, n_ok & mine)
        else:
            acc = _dot(a, tl.trans(w), acc, FP32)
        # the slot's last chunk: weight its row and round it (a routed slot), or keep it (the shared one)
        last = k + BLOCK_K >= intermediate
        weighted = (acc * weight).to(dtype).to(tl.float32)
        routed = tl.where(last & (slot < TOP_K), routed + weighted, routed)
        shared = tl.where(last & is_shared, acc, shared)
        acc = tl.where(last, 0.0, acc)
    routed = tl.sum(routed, axis=0)  # the padding rows are zeros
    shared = tl.sum(shared, axis=0)
    finish, routed, shared = sum_split_partials(
        routed, shared, part_ptr, counter_ptr, token, pid_n, offs_n, hidden, num_tokens, split, num_splits
    )
    if finish:
        args = (x_ptr, shared_gate_ptr, out_ptr, token, offs_n, hidden, stride_xm, stride_om)
        _down_epilogue(routed, shared, *args, SLOTS > TOP_K, GATE_BLOCK)


def check_shared(shared: SharedExpert, x: torch.Tensor, intermediate: int) -> None:
    """ValueError naming the tensor and the fix when the shared expert's tensors do not fit."""
    hidden = x.shape[1]
    problem = ""
    if shared.gate_up_proj.shape != (2 * intermediate, hidden):
        problem = (
            f"its gate_up_proj must be [2 x {intermediate}, {hidden}] (the routed experts' intermediate "
            f"width: a shared expert of another width takes the grouped path), got "
            f"{tuple(shared.gate_up_proj.shape)}"
        )
    elif shared.down_proj.shape != (hidden, intermediate):
        problem = f"its down_proj must be [{hidden}, {intermediate}], got {tuple(shared.down_proj.shape)}"
    elif shared.gate_weight.numel() != hidden:
        problem = f"its gate weight must hold {hidden} values, got {tuple(shared.gate_weight.shape)}"
    elif any(t.dtype != x.dtype for t in (shared.gate_up_proj, shared.down_proj, shared.gate_weight)):
        problem = (
            f"its weights must be in x's dtype {x.dtype} (a quantized shared expert takes the grouped path)"
        )
    elif shared.gate_up_proj.stride(1) != 1 or shared.down_proj.stride(1) != 1:
        problem = "its weights' last dims must be contiguous"
    elif not shared.gate_weight.is_contiguous():
        problem = "its gate weight must be contiguous"
    if problem:
        raise ValueError(f"moe_decode: the shared expert does not fit: {problem}")


def moe_decode(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor | Fp8Experts,
    down_proj: torch.Tensor | Fp8Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
    shared: SharedExpert | None = None,
    config: MoeDecodeConfig | None = None,
) -> torch.Tensor:
    """fused_moe's result (this rank's share of the MoE output [T, hidden] in x's dtype) in two kernels,
    plus the gated shared expert when given. The inputs as fused_moe takes them; fused_moe.check_inputs
    has checked them (fused_moe sends decode-sized batches here). A shared expert's slices must have the
    routed experts' intermediate width and x's dtype (`check_shared`). fp8 experts (Fp8Experts, as
    fused_moe_fp8.check_inputs checks them; layers/moe_fp8.py sends one token here) are streamed as e4m3
    and scaled in float32 per BLOCK_K step (W8A16: x and the intermediate stay 16-bit), with no shared
    expert."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_decode: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if x.shape[0] == 0:
        return torch.empty_like(x)
    fp8 = isinstance(gate_up_proj, Fp8Experts)
    if fp8 and shared is not None:
        raise ValueError("moe_decode: fp8 experts take no shared expert here (run it beside them)")
    if shared is not None:
        check_shared(shared, x, gate_up_proj.shape[1] // 2)
    x = x if x.stride(1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    config = config or DEFAULT_CONFIG
    mid = decode_gate_up(x, gate_up_proj, topk_ids, activation, first_expert, shared, config.gate_up)
    return decode_down(mid, x, down_proj, topk_ids, topk_weights, first_expert, shared, config)


def _weights(
    projection: torch.Tensor | Fp8Experts, tile: GemmTile, activations: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(data, scale, constexprs) of a projection: 16-bit weights pass themselves as their unread scale;
    fp8 ones their scale, and a BLOCK_K that divides their column groups (a step has one scale)."""
    if not isinstance(projection, Fp8Experts):
        return projection, projection, {"W_FP8": False, "GROUP_K": 1, "BLOCK_K": tile.block_k}
    block_k, _ = projection.step_k(tile.block_k)
    constexprs = {"W_FP8": True, "GROUP_K": projection.group_k, "BLOCK_K": block_k}
    # bytes below 8.9 and beside bfloat16 activations (kernels/fp8_bits.py)
    data = e4m3_as_stored(projection.data, projection.data.device, activations)
    return data, projection.scale, constexprs


def decode_gate_up(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor | Fp8Experts,
    topk_ids: torch.Tensor,
    activation: str,
    first_expert: int,
    shared: SharedExpert | None,
    tile: GemmTile,
) -> torch.Tensor:
    """moe_decode's first kernel: mid [T * slots, I], each slot's act(gate) * up (checked inputs)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    weight, scale, weight_constexprs = _weights(gate_up_proj, tile, x.dtype)
    local_experts, double_width, _ = weight.shape
    intermediate = double_width // 2
    slots = top_k + (shared is not None)
    # without a shared expert its pointers are never read (every slot is routed): pass the routed ones
    shared_gate_up = shared.gate_up_proj if shared is not None else weight
    mid = torch.empty((num_tokens * slots, intermediate), dtype=x.dtype, device=x.device)
    args = (x, weight, scale, shared_gate_up, mid, topk_ids, hidden, intermediate, first_expert)
    args += (local_experts, x.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1))
    args += (shared_gate_up.stride(0), mid.stride(0))
    constexprs = {
        "TOP_K": top_k,
        "SLOTS": slots,
        "ACTIVATION": ACTIVATIONS[activation],
        "FP32": x.dtype == torch.float32,
        **weight_constexprs,
        "BLOCK_M": TILE_ROWS,
        "BLOCK_N": tile.block_n,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (cdiv(intermediate, tile.block_n), num_tokens * slots)
    _launch(_decode_gate_up_kernel, grid, args, constexprs, x.device, tile.num_warps)
    return mid


def decode_down(
    mid: torch.Tensor,
    x: torch.Tensor,
    down_proj: torch.Tensor | Fp8Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    first_expert: int,
    shared: SharedExpert | None,
    config: MoeDecodeConfig,
) -> torch.Tensor:
    """moe_decode's second kernel: out [T, hidden] from decode_gate_up's mid (checked inputs, topk_weights
    float32)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    tile = config.down
    weight, scale, weight_constexprs = _weights(down_proj, tile, mid.dtype)
    local_experts, _, intermediate = weight.shape
    slots = top_k + (shared is not None)
    device = x.device
    shared_down = shared.down_proj if shared is not None else weight
    shared_gate = shared.gate_weight if shared is not None else x
    out = torch.empty_like(x)
    tiles = cdiv(hidden, tile.block_n)
    splits, per_split = down_splits(tiles, num_tokens, slots, sm_count(device), config.down_programs_per_sm)
    if config.down_slots_per_split is not None:
        per_split = min(config.down_slots_per_split, slots)
        splits = cdiv(slots, per_split)
    part_shape = (splits, 2, num_tokens, hidden) if splits > 1 else (1,)
    parts = torch.empty(part_shape, dtype=torch.float32, device=device)
    counters = device_counters("moe_decode", device, COUNTER_SLOTS)
    args = (mid, weight, scale, shared_down, x, shared_gate, topk_ids, topk_weights, out, parts, counters)
    args += (num_tokens, hidden, intermediate, first_expert, local_experts, splits, per_split)
    args += (mid.stride(0), weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1))
    args += (shared_down.stride(0), x.stride(0), out.stride(0))
    constexprs = {
        "TOP_K": top_k,
        "SLOTS": slots,
        "SLOTS_POW2": next_power_of_2(slots),
        "FP32": x.dtype == torch.float32,
        **weight_constexprs,
        "GATE_BLOCK": next_power_of_2(hidden),
        "BLOCK_M": TILE_ROWS,
        "BLOCK_N": tile.block_n,
        "NUM_STAGES": tile.num_stages,
    }
    _launch(_decode_down_kernel, (tiles, num_tokens, splits), args, constexprs, device, tile.num_warps)
    return out
