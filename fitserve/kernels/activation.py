"""SiLU-and-mul: silu(gate) * up in one pass over the packed gate_up projection; gelu-and-mul (tanh
approximation, Gemma-4's activation) likewise, or over a gate and an up given apart.

Reference: fitserve.kernels.reference.silu_and_mul_reference; gelu: torch's
`F.gelu(gate, approximate="tanh") * up`, rounded to the dtype after the gelu and after the product as
those two torch ops round.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv

BLOCK = 1024
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # the unit tests' CPU interpreter
_host_launched = (lambda function: function) if INTERPRETING else fast_launch
# sqrt(2 / pi), doubled: 0.5 * (1 + tanh(u)) == sigmoid(2u), so gelu_tanh(x) = x * sigmoid(2u) with
# u = sqrt(2 / pi) * (x + 0.044715 x^3), which needs no tanh and does not cancel for large |u|
_TWO_SQRT_2_OVER_PI = 1.5957691216057308


@_host_launched
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


@_host_launched
@triton.jit
def _gelu_tanh_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    intermediate_size,
    stride_gate,
    stride_up,
    stride_out,
    TWO_SQRT_2_OVER_PI: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    doubled = TWO_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    dtype = out_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-doubled))).to(dtype).to(tl.float32)  # rounded, as F.gelu's output
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(dtype), mask=mask)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate, up [N, I] (strided rows are fine) -> new tensor [N, I]."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(
            f"gelu_tanh_mul takes gate and up of one shape [N, intermediate] with a contiguous last dim; "
            f"got {tuple(gate.shape)} (strides {gate.stride()}) and {tuple(up.shape)} (strides {up.stride()})"
        )
    num_rows, intermediate_size = gate.shape
    out = torch.empty((num_rows, intermediate_size), dtype=gate.dtype, device=gate.device)
    if num_rows == 0 or intermediate_size == 0:
        return out
    grid = (num_rows, cdiv(intermediate_size, BLOCK))
    _gelu_tanh_and_mul_kernel[grid](
        gate,
        up,
        out,
        intermediate_size,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        TWO_SQRT_2_OVER_PI=_TWO_SQRT_2_OVER_PI,
        BLOCK=BLOCK,
        num_warps=4,
        **pdl_kwargs(gate.device),
    )
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2 * I] (gate columns, then up columns) -> new tensor gelu_tanh(gate) * up [N, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            "gelu_tanh_and_mul takes x [N, 2 * intermediate] with a contiguous last dim; got "
            f"{tuple(x.shape)}"
        )
    intermediate_size = x.shape[1] // 2
    return gelu_tanh_mul(x[:, :intermediate_size], x[:, intermediate_size:])
