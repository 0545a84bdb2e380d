"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim (each half d wide) -> silu(gate) * up, [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from fitserve.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        kernels = load_cpu_kernels()
        if kernels is not None and kernels.elementwise.silu_and_mul_supports(x):
            return kernels.elementwise.silu_and_mul(x)  # one C call (cpu/c_kernels/elementwise.c)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
