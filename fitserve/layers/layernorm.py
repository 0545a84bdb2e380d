"""RMSNorm as HF Llama/Qwen compute it: normalise in float32, cast back, then scale by the weight."""

from __future__ import annotations

import torch
from torch import nn

from fitserve.distributed.collectives import all_reduce, all_reduce_add_rms_norm
from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels
from fitserve.layers.cpu.rms_norm import cpu_rms_norm
from fitserve.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    """`norm(x)` -> normed; `norm(x, residual)` adds first and returns (normed, x + residual).

    The fused form lets a decoder layer carry the residual stream without a separate add per block:
    the sum is taken in the activations' dtype, exactly as HF's `residual + hidden_states`. On CUDA
    both forms run as one Triton kernel (fitserve.kernels.norm); the fused one works in place, so x
    and residual must not be read again by the caller.

    On the CPU, contiguous float32 rows take fitserve's C kernel where it builds (cpu/c_kernels/elementwise.c:
    the add and the norm in one call, in place like CUDA's; HF's formula with the squares summed in
    another order), else
    `cpu_rms_norm` (the kernels of torch's `F.rms_norm` in fewer calls): for float32 it computes the same
    values as HF's formula, bit for bit (a unit test checks it). Other dtypes keep HF's formula, whose
    casts F.rms_norm does not reproduce.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return cpu_rms_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            from fitserve.kernels.norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        kernels = load_cpu_kernels()
        if kernels is not None and kernels.elementwise.rms_norm_supports(x, residual, self.weight):
            if residual is None:
                return kernels.elementwise.rms_norm(x, self.weight, self.eps)
            return kernels.elementwise.add_rms_norm_(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def forward_sum(self, partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(sum of `partial` over the tensor-parallel ranks, residual): `partial` is a row-parallel
        layer's output before its all-reduce (RowParallelLinear.forward(x, reduce=False)). On GPUs the
        sum, the add and the norm are one kernel where the custom all-reduce takes them
        (distributed/collectives.py); on one rank the sum is `partial` itself."""
        if partial.is_cuda and partial.dtype == residual.dtype:
            return all_reduce_add_rms_norm(partial, residual, self.weight, self.eps)
        return self.forward(all_reduce(partial), residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
