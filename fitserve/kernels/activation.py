"""SiLU-and-mul: silu(gate) * up in one pass over the packed gate_up projection; gelu-and-mul (tanh
approximation, Gemma-4's activation) likewise, or over a gate and an up given apart; Qwen3.5/3.6's
attention output gate, out * sigmoid(gate) with the gate read from q_proj's per-head [query | gate] rows.

Reference: fitserve.kernels.reference.silu_and_mul_reference; gelu: torch's
`F.gelu(gate, approximate="tanh") * up`, rounded to the dtype after the gelu and after the product as
those two torch ops round; sigmoid_gate_mul: models/qwen3_5_layers.py's
`out * torch.sigmoid(gate.reshape(tokens, -1))`, likewise rounded after the sigmoid and after the product
(exactly its numbers: sigmoid is 1 / (1 + exp(-x)) in float32 with an IEEE-rounded division and the CUDA
math library's exp, as torch's: bit for bit equal to torch's CUDA path on an H200, 1.1 us at batch 1 in
a CUDA graph against 4.8, 50 us at 8192 tokens x 16 heads x 256 against 174).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import INTERPRETING, host_launched
from fitserve.kernels.grid_math import cdiv, heads_per_program, next_power_of_2

BLOCK = 1024
HEAD_TILE = 1024  # sigmoid_gate_mul: values a program holds, whole heads (grid_math.heads_per_program)
# sqrt(2 / pi), doubled: 0.5 * (1 + tanh(u)) == sigmoid(2u), so gelu_tanh(x) = x * sigmoid(2u) with
# u = sqrt(2 / pi) * (x + 0.044715 x^3), which needs no tanh and does not cancel for large |u|
_TWO_SQRT_2_OVER_PI = 1.5957691216057308
# torch's CUDA kernels take exp from the CUDA math library (expf), which libdevice's __nv_expf is; Triton's
# tl.exp is ex2.approx(x * log2(e)), some ulp away, enough to move a rounding to the model dtype now and
# then (on an H200, over 4M float32 values in [-30, 30]: tl.exp differed from torch.exp in 85% of them,
# libdevice's exp in none). The interpreter has no libdevice (numpy's exp there).
_LIBDEVICE_EXP: tl.constexpr = tl.constexpr(not INTERPRETING)


@triton.jit
def exp_as_torch(x):
    """exp(x) of float32 x as torch computes it on CUDA (expf); numpy's under the interpreter."""
    if _LIBDEVICE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@host_launched
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    AS_TORCH: tl.constexpr = False,  # F.silu(gate) * up's numbers: silu rounded to the dtype first
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    if AS_TORCH:
        silu = tl.div_rn(gate, 1.0 + exp_as_torch(-gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
        out = silu * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, as_torch: bool = False) -> torch.Tensor:
    """x [N, 2 * I] (gate columns, then up columns) -> new tensor [N, I]: silu(gate) * up in float32,
    rounded once; as_torch: torch's `F.silu(gate) * up` exactly (silu rounded to the dtype, then the
    product), as Qwen3.5's MLP computes it."""
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
        AS_TORCH=as_torch,
        num_warps=4,
        **pdl_kwargs(x.device),
    )
    return out


@host_launched
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


@host_launched
@triton.jit
def _sigmoid_gate_mul_kernel(
    x_ptr,
    query_gate_ptr,
    out_ptr,
    num_heads,
    stride_x,
    stride_gate_token,
    stride_gate_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (cols < HEAD_DIM)[None, :]
    within = heads[:, None] * HEAD_DIM + cols[None, :]
    x = tl.load(x_ptr + token * stride_x + within, mask=mask, other=0.0).to(tl.float32)
    # each head's gate: the second HEAD_DIM values of its [query | gate] row
    gate_row = query_gate_ptr + token * stride_gate_token + heads[:, None] * stride_gate_head + HEAD_DIM
    gate = tl.load(gate_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    sigmoid = (
        tl.div_rn(1.0, 1.0 + exp_as_torch(-gate)).to(dtype).to(tl.float32)
    )  # rounded, as torch.sigmoid's
    tl.store(out_ptr + token * (num_heads * HEAD_DIM) + within, (x * sigmoid).to(dtype), mask=mask)


def sigmoid_gate_mul(x: torch.Tensor, query_gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5/3.6's gated attention output: x * sigmoid(gate) as a new contiguous [T, H * D] tensor.

    x [T, H * D]: the attention output, last dim contiguous; query_gate [T, H, 2D]: q_proj's output
    viewed per head (each head's query, then its gate; only the gate is read), last dim contiguous; one
    dtype (float16, bfloat16 or float32). Reads no host data: CUDA-graph safe."""
    if query_gate.dim() != 3 or query_gate.shape[2] % 2 or query_gate.stride(-1) != 1:
        raise ValueError(
            f"sigmoid_gate_mul takes query_gate [T, H, 2 * D] with a contiguous last dim; got query_gate "
            f"{tuple(query_gate.shape)} (strides {query_gate.stride()})"
        )
    num_tokens, num_heads, width = query_gate.shape
    head_dim = width // 2
    if x.shape != (num_tokens, num_heads * head_dim) or x.stride(-1) != 1:
        raise ValueError(
            f"sigmoid_gate_mul needs x [T, H * D] = {(num_tokens, num_heads * head_dim)} (query_gate "
            f"{tuple(query_gate.shape)}) with a contiguous last dim; got x {tuple(x.shape)} (strides "
            f"{x.stride()})"
        )
    if x.dtype != query_gate.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"sigmoid_gate_mul needs x and query_gate in one of float16, bfloat16, float32; got x {x.dtype}, "
            f"query_gate {query_gate.dtype}"
        )
    out = torch.empty((num_tokens, num_heads * head_dim), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = next_power_of_2(head_dim)
    block_h = heads_per_program(num_heads, block_d, HEAD_TILE)
    _sigmoid_gate_mul_kernel[(num_tokens, cdiv(num_heads, block_h))](
        x,
        query_gate,
        out,
        num_heads,
        x.stride(0),
        query_gate.stride(0),
        query_gate.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 1024 else 8,
        **pdl_kwargs(x.device),
    )
    return out
