"""A row-parallel layer's sum over the ranks, the residual add and the RMSNorm after it, in one kernel.

In a tensor-parallel decoder the output of o_proj and of down_proj is a partial sum on each rank; the
next thing the layer does is add the sum to the residual stream and normalise it (the post-attention
norm, the next layer's input norm, the final norm). Here one program a row exchanges the row with every
rank as kernels/one_shot_all_reduce.py does (`_exchange`: push, flags, wait, float32 sum in rank order)
and goes on with kernels/norm.py's fused_add_rms_norm on the sum: one launch and one kernel boundary
fewer than the all-reduce followed by the norm, per norm of the step.

The sum is rounded to the activations' dtype before the residual add, as the all-reduce's output is
before kernels/norm.py adds it, so the results are the bits of the two kernels run one after the other.

Its buffers (distributed/custom_all_reduce.py) are its own, apart from the plain all-reduce's: program
`row` owns the ROW_SLOT elements at row * ROW_SLOT of each slot, and its flags and counters are separate,
so the parity rule of one_shot_all_reduce.py holds for each program here as there.
Reference: torch.distributed.all_reduce, then kernels/norm.py fused_add_rms_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import next_power_of_2
from fitserve.kernels.norm import _num_warps
from fitserve.kernels.one_shot_all_reduce import MAX_WORLD, POLLS_PER_CHECK, _exchange, peer_pointers

# Rows a call may have (one program each) and the longest row (elements).
MAX_ROWS = 64
ROW_SLOT = 16384


@fast_launch
@triton.jit(do_not_specialize=["timeout_ns"])
def _one_shot_all_reduce_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    hidden_size,
    stride_x,
    stride_residual,
    eps,
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,
    d6,
    d7,
    f0,
    f1,
    f2,
    f3,
    f4,
    f5,
    f6,
    f7,
    counters_ptr,
    abort_ptr,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    WORLD_POW2: tl.constexpr,
    SLOT: tl.constexpr,
    ROW_SLOT: tl.constexpr,
    BLOCK: tl.constexpr,
    POLLS_PER_CHECK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # never written in a step
    wait_for_previous_kernel(USE_PDL)
    epoch = tl.load(counters_ptr + row) + 1
    x_row = x_ptr + row.to(tl.int64) * stride_x + cols
    partial = tl.load(x_row, mask=mask, other=0.0)
    total = _exchange(
        partial, row * ROW_SLOT + cols, mask, row, epoch,
        d0, d1, d2, d3, d4, d5, d6, d7, f0, f1, f2, f3, f4, f5, f6, f7,
        abort_ptr, timeout_ns, RANK, WORLD, WORLD_POW2, SLOT, POLLS_PER_CHECK,
    )  # fmt: skip
    reduced = total.to(x_ptr.dtype.element_ty).to(tl.float32)  # the all-reduce's output
    residual_row = residual_ptr + row.to(tl.int64) * stride_residual + cols
    summed = (reduced + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)).to(
        residual_ptr.dtype.element_ty
    )
    tl.store(residual_row, summed, mask=mask)
    s = summed.to(tl.float32)
    normed = (s * tl.rsqrt(tl.sum(s * s, axis=0) / hidden_size + eps)).to(x_ptr.dtype.element_ty)
    tl.store(x_row, (normed.to(tl.float32) * weight).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(counters_ptr + row, epoch)


def takes(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one_shot_all_reduce_norm takes these: [rows <= MAX_ROWS, hidden <= ROW_SLOT] 16-bit rows with
    a contiguous last dim, residual alike, weight [hidden]."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] <= ROW_SLOT
        and x.dtype in (torch.bfloat16, torch.float16)
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and x.stride(1) == 1
        and residual.stride(1) == 1
        and tuple(weight.shape) == (x.shape[1],)
    )


def one_shot_all_reduce_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rank: int,
    data: list[torch.Tensor],
    flags: list[torch.Tensor],
    counters: torch.Tensor,
    abort: torch.Tensor,
    timeout_ns: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- sum over the ranks of x + residual, x <- rms_norm(residual) * weight. Returns
    (x, residual). `data[s]` (x's dtype, 2 x world x MAX_ROWS * ROW_SLOT elements), `flags[s]` (int64,
    MAX_ROWS x world): rank s's, as this rank addresses them; `counters` (int64, MAX_ROWS) and `abort`
    this rank's own."""
    world = len(data)
    if not takes(x, residual, weight) or not 1 <= world <= MAX_WORLD:
        raise ValueError(
            f"one_shot_all_reduce_norm takes 16-bit x and residual [1..{MAX_ROWS}, <= {ROW_SLOT}] with a "
            f"contiguous last dim and weight [hidden], over 1 to {MAX_WORLD} ranks; got x {tuple(x.shape)} "
            f"{x.dtype}, residual {tuple(residual.shape)} {residual.dtype}, weight {tuple(weight.shape)}, "
            f"{world} ranks: all-reduce, then kernels/norm.py fused_add_rms_norm"
        )
    block = next_power_of_2(x.shape[1])
    _one_shot_all_reduce_norm_kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        x.shape[1],
        x.stride(0),
        residual.stride(0),
        eps,
        *peer_pointers(data, flags, rank),
        counters,
        abort,
        timeout_ns,
        RANK=rank,
        WORLD=world,
        WORLD_POW2=next_power_of_2(world),
        SLOT=MAX_ROWS * ROW_SLOT,
        ROW_SLOT=ROW_SLOT,
        BLOCK=block,
        POLLS_PER_CHECK=POLLS_PER_CHECK,
        num_warps=_num_warps(block),  # kernels/norm.py's: the same sum of squares, the same bits
        **pdl_kwargs(x.device),
    )
    return x, residual
