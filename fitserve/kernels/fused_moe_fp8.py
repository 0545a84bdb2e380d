"""Fused mixture-of-experts over fp8 experts (an FP8 checkpoint's: Qwen3-30B-A3B-FP8, Qwen3.6-35B-A3B-FP8,
compressed-tensors FP8 MoE releases): kernels/fused_moe.py's grouped path with 1-byte weights.

The routing (`fused_moe.moe_route`) and the sum of each token's k rows (`fused_moe.sum_pair_rows`) are
fused_moe.py's; the two GEMMs are its kernels with the weight tile loaded as float8 e4m3, in the canonical
fp8 form (layers/quantization/fp8_weight.py) per expert:

    w[e, n, k] = float(data[e, n, k]) * scale[e, n, k // GROUP_K]

GROUP_K = K with one scale a row (per-tensor and per-channel checkpoints), or the block's columns (128 for
Qwen's and DeepSeek's [128, 128] blocks, each block's scale repeated over its rows). Two arithmetics
(moe_parts.scaled_step):
- W8A8 (the default where the hidden size is whole A_GROUP-column groups, as vLLM runs these checkpoints):
  x quantized per token and A_GROUP columns (kernels/fp8_quant.quantize_groups, amax / 448), each BLOCK_K
  step an fp8 x fp8 product (Hopper's fp8 wgmma; mma on Ada) times the rows' activation scales and, with
  column groups, the weight's; the gate_up kernel quantizes its act(gate) * up tile (A_GROUP columns, one
  group) per row the same way for the down kernel. Tile rows by the pairs an expert gets (`w8a8_block_m`);
  on Hopper, tiles under 64 rows take the weight tile as the MMA's rows (`swaps_operands`), and read it
  through a TMA descriptor (`weight_descriptor`, `loads_weights_by_tma`).
- W8A16: the tile converted to the activation dtype (exact: every e4m3 value is a bfloat16 and a float16;
  into bfloat16 from the weight's bytes, fp8_bits.stored_values), the partial products scaled in float32;
  the activations stay 16-bit.
With one scale a row the weight's scale multiplies the accumulator once at the end; with column groups
each step (BLOCK_K divides GROUP_K and A_GROUP) is scaled before it is added.

Weights as layers/moe_fp8.py keeps them: gate_up [E, 2I, hidden] (gate rows then up rows) with its scale
[E, 2I, G_hidden], down [E, hidden, I] with [E, hidden, G_I]. One token takes kernels/moe_decode.py's
kernels instead (layers/moe_fp8.py). Runs from compute capability 7.5 (`fp8_experts_run_on`); below 8.9,
where Triton has no e4m3 and the GPU no fp8 tensor cores, W8A16 only, on the weights viewed as bytes that
kernels/fp8_bits.py decodes (`e4m3_as_stored`). The Triton interpreter runs the same arithmetic (tests).
No host sync, so CUDA graphs capture it for any routing.

Reference: layers/moe_fp8.py Fp8FusedExperts.reference (tests/unit/test_fused_moe_fp8_interpret.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary
from triton.tools.tensor_descriptor import TensorDescriptor

from fitserve.kernels.capability import (
    FP8_WEIGHTS_MIN_CAPABILITY,
    has_e4m3_conversion,
    kernel_capability,
    shared_memory_per_block,
)
from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.fast_launch import INTERPRETING, host_launched
from fitserve.kernels.fp8_bits import e4m3_as_stored
from fitserve.kernels.fp8_quant import INV_FP8_MAX, quantize_groups, to_e4m3
from fitserve.kernels.fused_moe import FusedMoeConfig, choose_config, moe_route, sum_pair_rows
from fitserve.kernels.grid_math import cdiv
from fitserve.kernels.moe_parts import ACTIVATIONS, Fp8Experts  # noqa: F401 (re-exported)
from fitserve.kernels.moe_parts import activation as _activation
from fitserve.kernels.moe_parts import launch as _launch
from fitserve.kernels.moe_parts import pair_block as _pair_block
from fitserve.kernels.moe_parts import scaled_step as _scaled_step

FP8 = torch.float8_e4m3fn
A_GROUP = 128  # W8A8: activation columns per scale (the layer's input and the intermediate alike)


def fp8_experts_run_on(device: torch.device) -> bool:
    """Whether the kernels run on `device`: CUDA at compute capability FP8_WEIGHTS_MIN_CAPABILITY and up
    (a forced target counts, kernels/capability.py)."""
    capability = kernel_capability(device) if device.type == "cuda" else None
    return capability is not None and capability >= FP8_WEIGHTS_MIN_CAPABILITY


@triton.jit
def _row_scales(scale_rows, stride_group, k, A_FP8: tl.constexpr, A_GROUP: tl.constexpr, row_ok):
    """W8A8: the rows' activation scales of column k's group (scale_rows: each row's first); else unused."""
    if A_FP8:
        scales = tl.load(scale_rows + (k // A_GROUP) * stride_group, mask=row_ok, other=0.0)
    else:
        scales = row_ok.to(tl.float32)  # W8A16 reads nothing of it
    return scales


@triton.jit
def _swapped_step(acc_t, a, a_scale, w_tile, s_rows, k, GROUP_K: tl.constexpr, PER_ROW: tl.constexpr, ok):
    """W8A8 with the operands swapped: acc_t [BLOCK_N, BLOCK_M] + (w_tile @ a.T) times the scales, the
    weight rows the MMA's rows. Hopper's fp8 warpgroup MMA takes 64 rows or more; a tile of 16 or 32
    token rows in the plain form lowers to mma.sync on float16, converting every weight (sm_90 SASS:
    HMMA and an F2FP a weight pair against QGMMA and none swapped)."""
    part = tl.dot(w_tile, tl.trans(a))
    if PER_ROW:
        acc_t = acc_t + part * a_scale[None, :]
    else:
        scale = tl.load(s_rows + k // GROUP_K, mask=ok, other=0.0)
        acc_t = acc_t + part * (scale[:, None] * a_scale[None, :])
    return acc_t


@triton.jit
def _store_quantized(values, q_ptrs, scale_ptrs, mask, row_ok, EXACT_BITS: tl.constexpr):
    """W8A8's intermediate: each row of the [BLOCK_M, BLOCK_N] tile (one activation group) as e4m3 with
    its scale amax / 448 (at least 1e-12), as kernels/fp8_quant.py quantizes the layer's input."""
    scale = tl.maximum(tl.max(tl.abs(values), axis=1) * INV_FP8_MAX, 1e-12)
    quantized = tl.minimum(tl.maximum(tl.div_rn(values, scale[:, None]), -448.0), 448.0)
    tl.store(q_ptrs, to_e4m3(quantized, EXACT_BITS), mask=mask)
    tl.store(scale_ptrs, scale, mask=row_ok)


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_fp8_gate_up_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    s_ptr,
    mid_ptr,
    mid_scale_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    top_k,
    hidden,
    intermediate,
    stride_xm,
    stride_xsm,
    stride_xsg,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_mm,
    stride_msm,
    ACTIVATION: tl.constexpr,
    GROUP_K: tl.constexpr,
    PER_ROW: tl.constexpr,
    A_FP8: tl.constexpr,
    A_GROUP: tl.constexpr,
    EXACT_BITS: tl.constexpr,
    SWAP_AB: tl.constexpr,
    W_DESC: tl.constexpr,
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
    x_scales = x_scale_ptr + token * stride_xsm
    if W_DESC:  # w_ptr: a TMA descriptor over the weights as [E * 2I, hidden] (`weight_descriptor`)
        gate_row = (expert * 2 * intermediate).to(tl.int32) + (pid % blocks_n) * BLOCK_N
    else:
        gate_rows = w_ptr + expert * stride_we + rows64[:, None] * stride_wn
        up_rows = gate_rows + intermediate * stride_wn
    gate_scales = s_ptr + expert * stride_se + rows64 * stride_sn
    up_scales = gate_scales + intermediate * stride_sn
    if SWAP_AB:  # transposed tiles (_swapped_step), turned back after the loop
        gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k + offs_k) < hidden
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:  # rows past the expert's are other weights (or zeros): their outputs are not stored
            w_gate = w_ptr.load([gate_row, k])
            w_up = w_ptr.load([gate_row + intermediate, k])
        else:
            w_mask = n_ok[:, None] & k_ok[None, :]
            w_gate = tl.load(gate_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
            w_up = tl.load(up_rows + (k + offs_k)[None, :], mask=w_mask, other=0.0)
        a_scale = _row_scales(x_scales, stride_xsg, k, A_FP8, A_GROUP, row_ok)
        if SWAP_AB:
            gate = _swapped_step(gate, a, a_scale, w_gate, gate_scales, k, GROUP_K, PER_ROW, n_ok)
            up = _swapped_step(up, a, a_scale, w_up, up_scales, k, GROUP_K, PER_ROW, n_ok)
        else:
            gate = _scaled_step(gate, a, a_scale, w_gate, gate_scales, k, GROUP_K, PER_ROW, A_FP8, n_ok)
            up = _scaled_step(up, a, a_scale, w_up, up_scales, k, GROUP_K, PER_ROW, A_FP8, n_ok)
    if SWAP_AB:
        gate = tl.trans(gate)
        up = tl.trans(up)
    if PER_ROW:
        gate *= tl.load(gate_scales, mask=n_ok, other=0.0)[None, :]
        up *= tl.load(up_scales, mask=n_ok, other=0.0)[None, :]
    mid = _activation(gate, ACTIVATION) * up
    out = mid_ptr + rows.to(tl.int64)[:, None] * stride_mm + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if A_FP8:  # the tile's BLOCK_N columns are one group of the down kernel's fp8 input
        scales = mid_scale_ptr + rows.to(tl.int64) * stride_msm + pid % blocks_n
        _store_quantized(tl.where(mask, mid, 0.0), out, scales, mask, row_ok, EXACT_BITS)
    else:
        tl.store(out, mid.to(mid_ptr.dtype.element_ty), mask=mask)


@host_launched
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_fp8_down_kernel(
    mid_ptr,
    mid_scale_ptr,
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
    stride_msm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_pm,
    GROUP_K: tl.constexpr,
    PER_ROW: tl.constexpr,
    A_FP8: tl.constexpr,
    A_GROUP: tl.constexpr,
    SWAP_AB: tl.constexpr,
    W_DESC: tl.constexpr,
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
    a_scales = mid_scale_ptr + rows.to(tl.int64) * stride_msm
    if W_DESC:  # w_ptr: a TMA descriptor over the weights as [E * hidden, I] (`weight_descriptor`)
        w_row = (expert * hidden).to(tl.int32) + (pid % blocks_n) * BLOCK_N
    else:
        w_rows = w_ptr + expert * stride_we + rows64[:, None] * stride_wn
    scales = s_ptr + expert * stride_se + rows64 * stride_sn
    if SWAP_AB:  # a transposed tile (_swapped_step), turned back after the loop
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, intermediate, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = (k + offs_k) < intermediate
        a = tl.load(a_rows + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            w = w_ptr.load([w_row, k])
        else:
            w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = _row_scales(a_scales, 1, k, A_FP8, A_GROUP, row_ok)
        if SWAP_AB:
            acc = _swapped_step(acc, a, a_scale, w, scales, k, GROUP_K, PER_ROW, n_ok)
        else:
            acc = _scaled_step(acc, a, a_scale, w, scales, k, GROUP_K, PER_ROW, A_FP8, n_ok)
    if SWAP_AB:
        acc = tl.trans(acc)
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


def _stages_that_fit(stages: int, stage_bytes: int, device: torch.device) -> int:
    """At most `stages` pipeline stages, as many as a block's shared memory holds (kernels/capability.py:
    99 KiB a block on sm_89, 227 on Hopper) with Triton's stages - 1 buffers of stage_bytes and ~4 KiB of
    the kernel's own; at least 2."""
    budget = shared_memory_per_block(kernel_capability(device)) - 4096
    return max(2, min(stages, 1 + budget // stage_bytes))


def w8a8_block_m(num_pairs: int, local_experts: int, device: torch.device) -> int:
    """W8A8's rows a tile by the pairs an expert gets on average: a tile of 64 rows over an expert's 8 runs
    mostly padding. Measured on an H200 at Qwen3-30B-A3B's shape: before the swap (benchmarks/results/
    h200_fused_moe_fp8.json) 128 tokens (8 pairs an expert) 185 us at 16 rows against 310 at 64, 512
    tokens (32 an expert) 290 us at 32 rows, 311 at 16, 322 at 64; swapped (`swaps_operands`,
    h200_fused_moe_fp8_swapped.json) 32 rows win from 16 pairs an expert (256 tokens: 197 us against 206
    at 16 rows) to 128 (2,048 tokens: 575 us against 747 at 64), and larger batches keep them."""
    pairs_per_expert = num_pairs / local_experts
    if _hopper_mma(device):
        return 16 if pairs_per_expert < 12 else 32
    return 16 if pairs_per_expert < 24 else 32 if pairs_per_expert < 96 else 64


SWAPPED_BELOW_ROWS = 64  # tiles of fewer token rows swap (`swaps_operands`)


def swaps_operands(w8a8: bool, block_m: int, device: torch.device) -> bool:
    """Whether the W8A8 kernels take the weight tile as the MMA's rows (`_swapped_step`): tiles of fewer
    than 64 token rows on Hopper (sm_90+, fp8 warpgroup MMAs of 64 rows; Ada's fp8 mma.sync takes 16
    either way); a forced sm_90 target counts, so the interpreter runs the swapped form too."""
    return w8a8 and block_m < SWAPPED_BELOW_ROWS and _hopper_mma(device)


def _hopper_mma(device: torch.device) -> bool:
    capability = kernel_capability(device)
    return capability is not None and capability >= (9, 0)


TMA_WEIGHTS = True  # benchmarks/gpu/fused_moe_fp8_bench.py --no-tma turns it off to compare
# each weight tensor's (address and shape, {box: descriptor}): dropped with the tensor (a descriptor holds
# its storage), and replaced when the tensor's storage or shape has changed since
_descriptors: WeakIdKeyDictionary = WeakIdKeyDictionary()


def weight_descriptor(data: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """A TMA descriptor over contiguous fp8 weights [E, N, K] as [E * N, K] in [block_n, block_k] boxes,
    made once per weight tensor and box (its address, shape and strides: valid while the weights are)."""
    experts, rows, cols = data.shape
    where = (data.data_ptr(), experts, rows, cols)
    kept = _descriptors.get(data)
    if kept is None or kept[0] != where:
        kept = _descriptors[data] = (where, {})
    descriptor = kept[1].get((block_n, block_k))
    if descriptor is None:
        # the rows over data's storage, not a view of data (a view keeps its base, the key, alive)
        as_rows = torch.empty(0, dtype=data.dtype, device=data.device)
        as_rows.set_(data.untyped_storage(), data.storage_offset(), (experts * rows, cols), (cols, 1))
        descriptor = kept[1][(block_n, block_k)] = TensorDescriptor.from_tensor(as_rows, [block_n, block_k])
    return descriptor


def loads_weights_by_tma(data: torch.Tensor, swap: bool) -> bool:
    """Whether the swapped W8A8 kernels read `data` through a TMA descriptor (`weight_descriptor`): on
    Hopper and up (swap), from a 16-byte aligned base with rows of whole 16-byte units, as the copy engine
    needs; never in the interpreter."""
    return (
        TMA_WEIGHTS
        and swap
        and not INTERPRETING
        and data.dtype == FP8
        and data.is_contiguous()
        and data.data_ptr() % 16 == 0
        and data.shape[2] % 16 == 0
    )


def kernel_weights(
    data: torch.Tensor, swap: bool, block_n: int, block_k: int
) -> tuple[torch.Tensor | TensorDescriptor, bool]:
    """(the weights argument of a grouped kernel, its W_DESC): a descriptor where `loads_weights_by_tma`,
    else the tensor."""
    if loads_weights_by_tma(data, swap):
        return weight_descriptor(data, block_n, block_k), True
    return data, False


def runs_w8a8(x: torch.Tensor) -> bool:
    """Whether fused_moe_fp8 quantizes the activations (W8A8): a hidden size of whole A_GROUP groups, on a
    GPU with fp8 tensor cores (8.9 and up; the interpreter too)."""
    return x.shape[-1] % A_GROUP == 0 and has_e4m3_conversion(kernel_capability(x.device))


def fused_moe_fp8(
    x: torch.Tensor,
    gate_up: Fp8Experts,
    down: Fp8Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    activation: str,
    first_expert: int = 0,
    w8a8: bool | None = None,
    config: FusedMoeConfig | None = None,
) -> torch.Tensor:
    """x [T, hidden] (bfloat16 / float16), this rank's experts first_expert .. first_expert + E - 1,
    topk_ids / topk_weights [T, k] -> this rank's share of the MoE output [T, hidden] in x's dtype.

    w8a8 (default: `runs_w8a8`): x quantized per token and A_GROUP columns (fp8_quant's
    quantize_groups, vLLM's and DeepGEMM's dynamic 1 x 128 scheme) and the intermediate per
    row of each gate_up tile (A_GROUP columns), the products fp8 x fp8 on the tensor cores; else W8A16.
    config: the tiles as given (benchmarks/gpu/fused_moe_fp8_bench.py's sweep; under W8A8 gate_up's
    block_n must be A_GROUP), else fused_moe.choose_config's with W8A8's gate_up tile."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe_fp8: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    check_inputs(x, gate_up, down, topk_ids)
    w8a8 = runs_w8a8(x) if w8a8 is None else w8a8
    if w8a8 and not runs_w8a8(x):
        needs = (
            f"a hidden size of whole {A_GROUP}-column groups, got {x.shape[1]}"
            if x.shape[1] % A_GROUP
            else f"fp8 tensor cores (compute capability 8.9), got {kernel_capability(x.device)}"
        )
        raise ValueError(f"fused_moe_fp8: W8A8 needs {needs}: pass w8a8=False")
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
    tuned = config is None
    config = config or choose_config(num_tokens, hidden, intermediate, top_k, local_experts)
    if tuned and w8a8:
        config = dataclasses.replace(
            config, block_m=w8a8_block_m(num_tokens * top_k, local_experts, x.device)
        )
    elif w8a8 and config.gate_up.block_n != A_GROUP:  # its tile is one group of the intermediate's scales
        raise ValueError(
            f"fused_moe_fp8: W8A8's gate_up block_n must be {A_GROUP}, got {config.gate_up.block_n}"
        )
    block_m = config.block_m
    num_pairs = num_tokens * top_k
    sorted_pairs, block_expert, num_blocks = moe_route(
        topk_ids, local_experts, first_expert, block_m, config.one_program_routing
    )
    blocks = block_expert.shape[0]
    device = x.device
    swap = swaps_operands(w8a8, block_m, device)

    tile = config.gate_up
    if w8a8 and tuned:  # the tile's columns are one group of the intermediate's fp8 scales
        tile = dataclasses.replace(
            tile,
            block_n=A_GROUP,
            block_k=128,
            num_warps=8 if block_m >= 64 else 4,
            # swapped: 3 stages, 5-10% ahead of 4 at 16 to 2,048 tokens (h200_fused_moe_fp8_swapped.json)
            num_stages=_stages_that_fit(
                3 if swap else tile.num_stages, block_m * 128 + 2 * A_GROUP * 128, device
            ),
        )
    if w8a8:
        x_q, x_scale = quantize_groups(x)
        mid_dtype, mid_groups = FP8, cdiv(intermediate, A_GROUP)
    else:
        x_q, x_scale = x, x.new_empty((1, 1), dtype=torch.float32)
        mid_dtype, mid_groups = x.dtype, 1
    mid = torch.empty((blocks * block_m, intermediate), dtype=mid_dtype, device=device)
    mid_scale = torch.empty((blocks * block_m, mid_groups), dtype=torch.float32, device=device)
    block_k, per_row = gate_up.step_k(tile.block_k, A_GROUP if w8a8 else None)
    if tuned and not per_row and block_m >= 64:  # each scaled step's two partial products need registers
        tile = dataclasses.replace(tile, num_warps=8)  # 4 warps spilled on sm_89 / sm_90 (variants.py)
    data, scale = e4m3_as_stored(gate_up.data, device, None if w8a8 else x.dtype), gate_up.scale
    weights, tma = kernel_weights(data, swap, tile.block_n, block_k)
    args = (x_q, x_scale, weights, scale, mid, mid_scale, sorted_pairs, block_expert, num_blocks, num_pairs)
    args += (top_k, hidden, intermediate, x_q.stride(0), x_scale.stride(0), x_scale.stride(1))
    args += (data.stride(0), data.stride(1), scale.stride(0), scale.stride(1), mid.stride(0))
    args += (mid_scale.stride(0),)
    constexprs = {
        "ACTIVATION": ACTIVATIONS[activation],
        "GROUP_K": gate_up.group_k,
        "PER_ROW": per_row,
        "A_FP8": w8a8,
        "A_GROUP": A_GROUP,
        "EXACT_BITS": INTERPRETING,
        "SWAP_AB": swap,
        "W_DESC": tma,
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": block_k,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (blocks * cdiv(intermediate, tile.block_n),)
    _launch(_moe_fp8_gate_up_kernel, grid, args, constexprs, device, tile.num_warps)

    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    tile = config.down
    if w8a8 and tuned:  # the grouped sweep's best down tiles: 4 warps below 64 rows, 3 stages swapped
        warps, stages = 8 if block_m >= 64 else 4, 3 if swap else tile.num_stages
        tile = dataclasses.replace(tile, block_k=128, num_warps=warps, num_stages=stages)
    block_k, per_row = down.step_k(tile.block_k, A_GROUP if w8a8 else None)
    data, scale = e4m3_as_stored(down.data, device, None if w8a8 else x.dtype), down.scale
    weights, tma = kernel_weights(data, swap, tile.block_n, block_k)
    args = (mid, mid_scale, weights, scale, topk_weights, per_pair, sorted_pairs, block_expert, num_blocks)
    args += (num_pairs, hidden, intermediate, mid.stride(0), mid_scale.stride(0), data.stride(0))
    args += (data.stride(1), scale.stride(0), scale.stride(1), per_pair.stride(0))
    constexprs = {
        "GROUP_K": down.group_k,
        "PER_ROW": per_row,
        "A_FP8": w8a8,
        "A_GROUP": A_GROUP,
        "SWAP_AB": swap,
        "W_DESC": tma,
        "BLOCK_M": block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": block_k,
        "NUM_STAGES": tile.num_stages,
    }
    grid = (blocks * cdiv(hidden, tile.block_n),)
    _launch(_moe_fp8_down_kernel, grid, args, constexprs, device, tile.num_warps)
    return sum_pair_rows(per_pair, topk_ids, out, first_expert, local_experts)
