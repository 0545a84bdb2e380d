"""RMSNorm, alone and fused with the residual add: one read and one write per row.

Semantics are HF Llama/Qwen's (see fitserve.kernels.reference.rms_norm_reference and
fused_add_rms_norm_reference): the residual sum is rounded to the activation dtype before it is
normalised, the normalised row is rounded before the weight multiplies it.

Gemma-4's norms (gemma_rms_norm, gemma_norm_add) round once, after the weight (its RMSNorm multiplies in
float32), may have no weight (v_norm, the router's norm), and come where Gemma adds a sublayer's normed
output to the residual stream: residual + norm(x) [times layer_scalar] [then the next sublayer's norm], one
kernel where torch took 5 per norm and one per add or multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import next_power_of_2


@host_launched
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
    WEIGHT_OFFSET: tl.constexpr = 0.0,  # the weight used is stored + offset (Qwen3.5's 1 + weight)
    ROUND_NORMED: tl.constexpr = True,  # round the normalised row before the weight (Llama's order)
):
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    # The weight is never written during a step, so it may be read before the wait (the rule in
    # kernels/dependent_launch.py): its load, a DRAM miss once a GEMM has streamed past the L2, leaves
    # the chain of dependent loads that sets a batch-1 norm's latency.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + WEIGHT_OFFSET
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
    normed = x * tl.rsqrt(variance + eps)
    if ROUND_NORMED:
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, out, mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0, round_normed: bool = True
) -> torch.Tensor:
    """x [N, hidden] or [N, H, hidden] (e.g. per-head q/k norm on a strided view) -> new contiguous tensor.

    weight_offset: the row is multiplied by weight + offset (Qwen3.5 stores the offset from 1);
    round_normed=False: rounded once, after the weight (Qwen3.5's and Gemma's RMSNorm multiply in float32)."""
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
        WEIGHT_OFFSET=weight_offset,
        ROUND_NORMED=round_normed,
        num_warps=_num_warps(block),
        **pdl_kwargs(x.device),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    round_normed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual). Returns (x, residual).

    x, residual [N, hidden], same dtype, contiguous last dim; x's old contents are gone afterwards.
    weight_offset and round_normed as in `rms_norm`.
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
        WEIGHT_OFFSET=weight_offset,
        ROUND_NORMED=round_normed,
        num_warps=_num_warps(block),
        **pdl_kwargs(x.device),
    )
    return x, residual


@triton.jit
def _gemma_normed(x, weight, hidden_size, eps, HAS_WEIGHT: tl.constexpr):
    """float32 row x -> x * (mean(x^2) + eps)^-0.5 [* weight], in float32 (the caller rounds once)."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    if HAS_WEIGHT:
        normed = normed * weight
    return normed


@host_launched
@triton.jit
def _gemma_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    scalar_ptr,
    next_weight_ptr,
    sum_ptr,
    out_ptr,
    hidden_size,
    rows_per_outer,
    stride_x_outer,
    stride_x_inner,
    stride_residual,
    stride_sum,
    stride_out,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ADD: tl.constexpr,
    HAS_SCALAR: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Without ADD: out = norm(x) [* weight]. With ADD: sum = residual + norm(x) * weight [then * scalar],
    each step rounded to the dtype as HF's torch ops round it; with HAS_NEXT, out = norm(sum) *
    next_weight."""
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    # parameters, never written during a step: read before the wait (kernels/dependent_launch.py)
    weight = cols.to(tl.float32)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    next_weight = weight
    if HAS_NEXT:
        next_weight = tl.load(next_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scalar = 1.0
    if HAS_SCALAR:
        scalar = tl.load(scalar_ptr).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    x_offset = (row // rows_per_outer).to(tl.int64) * stride_x_outer + (row % rows_per_outer) * stride_x_inner
    x = tl.load(x_ptr + x_offset + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    normed = _gemma_normed(x, weight, hidden_size, eps, HAS_WEIGHT).to(dtype)
    if ADD:
        residual = tl.load(residual_ptr + row.to(tl.int64) * stride_residual + cols, mask=mask, other=0.0)
        summed = (residual.to(tl.float32) + normed.to(tl.float32)).to(dtype)
        if HAS_SCALAR:
            summed = (summed.to(tl.float32) * scalar).to(dtype)
        tl.store(sum_ptr + row.to(tl.int64) * stride_sum + cols, summed, mask=mask)
        if HAS_NEXT:
            normed = _gemma_normed(summed.to(tl.float32), next_weight, hidden_size, eps, True).to(dtype)
            tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, normed, mask=mask)
    else:
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, normed, mask=mask)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma-4's RMSNorm: x [N, hidden] or [N, H, hidden] (a strided view is fine) -> a new contiguous
    tensor, x * (mean(x^2) + eps)^-0.5 * weight in float32, rounded once; weight None: no scale."""
    hidden_size = x.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or (weight is not None and weight.shape != (hidden_size,)):
        raise ValueError(
            f"gemma_rms_norm takes x [N, hidden] or [N, H, hidden] with a contiguous last dim and weight "
            f"[hidden] or None; got x {tuple(x.shape)} (strides {x.stride()}) and weight "
            f"{None if weight is None else tuple(weight.shape)}"
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // hidden_size if hidden_size else 0
    if num_rows == 0:
        return out
    block = next_power_of_2(hidden_size)
    _gemma_norm_kernel[(num_rows,)](
        x,
        x,
        x if weight is None else weight,
        x,
        x,
        out,
        out,
        hidden_size,
        x.shape[1] if x.dim() == 3 else 1,
        x.stride(0),
        x.stride(1) if x.dim() == 3 else 0,
        0,
        0,
        hidden_size,
        eps,
        HAS_WEIGHT=weight is not None,
        ADD=False,
        HAS_SCALAR=False,
        HAS_NEXT=False,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl_kwargs(x.device),
    )
    return out


def gemma_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Gemma-4's `residual + norm(x)` at the end of a sublayer: returns (normed, summed), new tensors.

    summed = residual + gemma_rms_norm(x, weight), rounded to the dtype, then times scalar ([1], the
    layer_scalar parameter, read on the device) and rounded again when given; normed =
    gemma_rms_norm(summed, next_weight) (the next sublayer's input norm), None without next_weight.
    x and residual [N, hidden] of one dtype with a contiguous last dim."""
    if x.dim() != 2 or x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"gemma_norm_add needs x and residual of one [N, hidden] shape and dtype; got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    hidden_size = x.shape[1]
    weights = [w for w in (weight, next_weight) if w is not None]
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or any(w.shape != (hidden_size,) for w in weights):
        raise ValueError(
            f"x and residual need a contiguous last dim and the weights [hidden] = [{hidden_size}]; got x "
            f"strides {x.stride()}, residual strides {residual.stride()}, weights "
            f"{[tuple(w.shape) for w in weights]}"
        )
    if scalar is not None and scalar.numel() != 1:
        raise ValueError(f"scalar must hold one value (layer_scalar); got shape {tuple(scalar.shape)}")
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    normed = torch.empty_like(summed) if next_weight is not None else None
    if x.shape[0] == 0:
        return normed, summed
    block = next_power_of_2(hidden_size)
    _gemma_norm_kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        x if scalar is None else scalar,
        x if next_weight is None else next_weight,
        summed,
        summed if normed is None else normed,
        hidden_size,
        1,
        x.stride(0),
        0,
        residual.stride(0),
        summed.stride(0),
        summed.stride(0),
        eps,
        HAS_WEIGHT=True,
        ADD=True,
        HAS_SCALAR=scalar is not None,
        HAS_NEXT=next_weight is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl_kwargs(x.device),
    )
    return normed, summed
