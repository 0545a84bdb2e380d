"""RMSNorm, alone and fused with the residual add: one read and one write per row.

Semantics are HF Llama/Qwen's (see fitserve.kernels.reference.rms_norm_reference and
fused_add_rms_norm_reference): the residual sum is rounded to the activation dtype before it is
normalised, the normalised row is rounded before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import next_power_of_2


@fast_launch
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden_size,
    rows_per_outer,
    stride_x_outer,
    stride_x_inner,
    stride_residual,
    stride_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    # The weight is never written during a step, so it may be read before the wait (the rule in
    # kernels/dependent_launch.py): its load, a DRAM miss once a GEMM has streamed past the L2, leaves
    # the chain of dependent loads that sets a batch-1 norm's latency.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    x_offset = (row // rows_per_outer).to(tl.int64) * stride_x_outer + (row % rows_per_outer) * stride_x_inner
    x = tl.load(x_ptr + x_offset + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row.to(tl.int64) * stride_residual + cols
        summed = (x + tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)).to(
            residual_ptr.dtype.element_ty
        )
        tl.store(residual_row, summed, mask=mask)
        x = summed.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    out = (normed.to(tl.float32) * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, out, mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, hidden] or [N, H, hidden] (e.g. per-head q/k norm on a strided view) -> new contiguous tensor."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm takes x [N, hidden] or [N, H, hidden] with a contiguous last dim and weight [hidden]; "
            f"got x {tuple(x.shape)} (strides {x.stride()}) and weight {tuple(weight.shape)}"
        )
    hidden_size = x.shape[-1]
    rows_per_outer = x.shape[1] if x.dim() == 3 else 1
    stride_inner = x.stride(1) if x.dim() == 3 else 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // hidden_size
    if num_rows == 0:
        return out
    block = next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x,
        x,
        weight,
        out,
        hidden_size,
        rows_per_outer,
        x.stride(0),
        stride_inner,
        0,
        hidden_size,
        eps,
        HAS_RESIDUAL=False,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl_kwargs(x.device),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual). Returns (x, residual).

    x, residual [N, hidden], same dtype, contiguous last dim; x's old contents are gone afterwards.
    """
    if x.shape != residual.shape or x.dim() != 2 or x.dtype != residual.dtype:
        raise ValueError(
            f"fused_add_rms_norm needs x and residual of one [N, hidden] shape and dtype; got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"x and residual need a contiguous last dim equal to weight's {tuple(weight.shape)}; "
            f"got x strides {x.stride()}, residual strides {residual.stride()}"
        )
    num_rows, hidden_size = x.shape
    if num_rows == 0:
        return x, residual
    block = next_power_of_2(hidden_size)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual,
        weight,
        x,
        hidden_size,
        1,
        x.stride(0),
        0,
        residual.stride(0),
        x.stride(0),
        eps,
        HAS_RESIDUAL=True,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl_kwargs(x.device),
    )
    return x, residual
