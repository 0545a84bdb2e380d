"""The norms around a Gemma-4 MoE block, each group in one kernel (models/gemma4_layers.py).

- gemma_moe_head: after attention, `residual + post_attention_norm(attention)`, and from that sum the three
  normed inputs of the block: the dense MLP's (pre_feedforward_layernorm), the experts'
  (pre_feedforward_layernorm_2) and the router's (its unscaled norm times scale * hidden^-0.5, folded into
  one float32 weight). The torch path takes five launches for it (kernels/norm.py's gemma_norm_add with
  the first norm, then one per other norm, the router's plus two multiplies).
- gemma_moe_tail: the dense MLP's and the experts' outputs each through its post-norm, added, through the
  layer's post-feedforward norm onto the residual stream, times layer_scalar: four launches in torch (two
  norms, the add, gemma_norm_add).

At batch 1 each launch is a few microseconds of the ~150 a 26B-A4B layer takes on an H100. Roundings are
the torch path's (each norm's output rounded to the dtype once, after its weight; each sum rounded), but
for the router's input, rounded once where torch rounds after the norm and after each multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import next_power_of_2
from fitserve.kernels.norm import _gemma_normed, _num_warps


@host_launched
@triton.jit
def _moe_head_kernel(
    x_ptr,
    residual_ptr,
    post_weight_ptr,
    dense_weight_ptr,
    routed_weight_ptr,
    router_weight_ptr,
    sum_ptr,
    dense_ptr,
    routed_ptr,
    router_ptr,
    hidden_size,
    stride_x,
    stride_residual,
    stride_out,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    # parameters, never written during a step: read before the wait (kernels/dependent_launch.py)
    post_weight = tl.load(post_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dense_weight = tl.load(dense_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    routed_weight = tl.load(routed_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    router_weight = tl.load(router_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _gemma_normed(x, post_weight, hidden_size, eps, True).to(dtype)
    summed = (residual + normed.to(tl.float32)).to(dtype)
    out = row * stride_out + cols
    tl.store(sum_ptr + out, summed, mask=mask)
    summed = summed.to(tl.float32)
    # the three norms share the sum's mean square: one rsqrt
    inverse_rms = tl.rsqrt(tl.sum(summed * summed, axis=0) / hidden_size + eps)
    tl.store(dense_ptr + out, (summed * inverse_rms * dense_weight).to(dtype), mask=mask)
    tl.store(routed_ptr + out, (summed * inverse_rms * routed_weight).to(dtype), mask=mask)
    tl.store(router_ptr + out, (summed * inverse_rms * router_weight).to(dtype), mask=mask)


@host_launched
@triton.jit
def _moe_tail_kernel(
    dense_ptr,
    routed_ptr,
    residual_ptr,
    dense_weight_ptr,
    routed_weight_ptr,
    post_weight_ptr,
    scalar_ptr,
    out_ptr,
    hidden_size,
    stride_dense,
    stride_routed,
    stride_residual,
    stride_out,
    eps,
    HAS_SCALAR: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    # parameters, never written during a step: read before the wait (kernels/dependent_launch.py)
    dense_weight = tl.load(dense_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    routed_weight = tl.load(routed_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    post_weight = tl.load(post_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scalar = 1.0
    if HAS_SCALAR:
        scalar = tl.load(scalar_ptr).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    dense = tl.load(dense_ptr + row * stride_dense + cols, mask=mask, other=0.0).to(tl.float32)
    routed = tl.load(routed_ptr + row * stride_routed + cols, mask=mask, other=0.0).to(tl.float32)
    dense = _gemma_normed(dense, dense_weight, hidden_size, eps, True).to(dtype)
    routed = _gemma_normed(routed, routed_weight, hidden_size, eps, True).to(dtype)
    mixed = (dense.to(tl.float32) + routed.to(tl.float32)).to(dtype)
    normed = _gemma_normed(mixed.to(tl.float32), post_weight, hidden_size, eps, True).to(dtype)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (residual + normed.to(tl.float32)).to(dtype)
    if HAS_SCALAR:
        summed = (summed.to(tl.float32) * scalar).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, summed, mask=mask)


def gemma_moe_head(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    dense_weight: torch.Tensor,
    routed_weight: torch.Tensor,
    router_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed, dense_in, routed_in, router_in), new [N, hidden] tensors: summed = residual +
    norm(x) * post_weight, and summed's norm times dense_weight, routed_weight and router_weight (any
    float dtype; the router's folded scale is float32). x and residual [N, hidden] of one dtype with a
    contiguous last dim, the weights [hidden]."""
    weights = (post_weight, dense_weight, routed_weight, router_weight)
    _check("gemma_moe_head", (x, residual), weights)
    summed = torch.empty_like(residual, memory_format=torch.contiguous_format)
    dense, routed, router = (torch.empty_like(summed) for _ in range(3))
    if residual.shape[0] == 0:
        return summed, dense, routed, router
    block = next_power_of_2(residual.shape[-1])
    _moe_head_kernel[(residual.shape[0],)](
        x,
        residual,
        *weights,
        summed,
        dense,
        routed,
        router,
        residual.shape[-1],
        x.stride(0),
        residual.stride(0),
        summed.stride(0),
        eps,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl_kwargs(residual.device),
    )
    return summed, dense, routed, router


def _check(name: str, rows: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...], scalar=None) -> None:
    shapes = {tuple(t.shape) for t in rows}
    dtypes = {t.dtype for t in rows}
    hidden_size = rows[-1].shape[-1]
    if (
        rows[-1].dim() != 2
        or len(shapes) != 1
        or len(dtypes) != 1
        or any(t.stride(-1) != 1 for t in rows)
        or any(w.shape != (hidden_size,) for w in weights)
        or (scalar is not None and scalar.numel() != 1)
    ):
        scalar_shape = None if scalar is None else tuple(scalar.shape)
        raise ValueError(
            f"{name} needs its rows of one [N, hidden] shape and dtype with a contiguous last dim, weights "
            f"[hidden] and a one-value scalar; got shapes {sorted(shapes)}, dtypes "
            f"{sorted(map(str, dtypes))}, weights {[tuple(w.shape) for w in weights]}, scalar {scalar_shape}"
        )


def gemma_moe_tail(
    dense: torch.Tensor,
    routed: torch.Tensor,
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    routed_weight: torch.Tensor,
    post_weight: torch.Tensor,
    eps: float,
    scalar: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + post_norm(dense_norm(dense) + routed_norm(routed)) [times scalar], a new [N, hidden]
    tensor; every input [N, hidden] of one dtype with a contiguous last dim, the weights [hidden], scalar
    one value (layer_scalar) or None."""
    _check("gemma_moe_tail", (dense, routed, residual), (dense_weight, routed_weight, post_weight), scalar)
    out = torch.empty_like(residual, memory_format=torch.contiguous_format)
    if residual.shape[0] == 0:
        return out
    hidden_size = residual.shape[-1]
    block = next_power_of_2(hidden_size)
    _moe_tail_kernel[(residual.shape[0],)](
        dense,
        routed,
        residual,
        dense_weight,
        routed_weight,
        post_weight,
        residual if scalar is None else scalar,
        out,
        hidden_size,
        dense.stride(0),
        routed.stride(0),
        residual.stride(0),
        out.stride(0),
        eps,
        HAS_SCALAR=scalar is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl_kwargs(residual.device),
    )
    return out
