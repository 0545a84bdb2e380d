"""The GPU form of a quantized linear layer: up to a row limit (decode) a fused kernel that dequantizes
inside the GEMM; more rows (prefill) chunks of the weight dequantized into a shared scratch buffer and
multiplied by cuBLAS. Each format names its two kernels, imported on first use (they import Triton)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Kernel = Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


class RowsSplitMethod:
    """`fused_max_rows`, and `kernels()` returning (fused, chunked): each takes (rows [M, K], packed,
    bias) and returns [M, N]."""

    fused_max_rows = 0

    def __init__(self, packed: Any) -> None:
        self.packed = packed
        self._kernels: tuple[Kernel, Kernel] | None = None

    def kernels(self) -> tuple[Kernel, Kernel]:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is None:
            self._kernels = self.kernels()
        fused, chunked = self._kernels
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        kernel = fused if rows.shape[0] <= self.fused_max_rows else chunked
        out = kernel(rows, self.packed, layer.bias)
        return out.view(*x.shape[:-1], out.shape[-1])
