"""SiLU-and-mul: silu(gate) * up in one pass over the packed gate_up projection.

Reference: fitserve.kernels.reference.silu_and_mul_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv

BLOCK = 1024


@fast_launch
@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, intermediate_size, stride_x, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2 * I] (gate columns, then up columns) -> new tensor [N, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"silu_and_mul takes x [N, 2 * intermediate] with a contiguous last dim; got {tuple(x.shape)}"
        )
    num_rows, width = x.shape
    intermediate_size = width // 2
    out = torch.empty((num_rows, intermediate_size), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    grid = (num_rows, cdiv(intermediate_size, BLOCK))
    _silu_and_mul_kernel[grid](
        x,
        out,
        intermediate_size,
        x.stride(0),
        out.stride(0),
        BLOCK=BLOCK,
        num_warps=4,
        **pdl_kwargs(x.device),
    )
    return out
