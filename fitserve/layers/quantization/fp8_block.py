"""Block-scaled fp8 W8A8 (DeepSeek / Qwen FP8 releases: 128 x 128 weight blocks) through torch's
`torch.nn.functional.scaled_mm` with BlockWise1x128 activations and BlockWise128x128 weights (cuBLASLt's
block-scaled fp8 GEMM, Hopper on).

Per call: x [M, K] is quantized to fp8 per token and per 128 columns (scale [M, K/128], amax / 448, as
the checkpoints' dynamic activation scheme does), M padded to a multiple of 4; y = the block-scaled
product in bfloat16. cuBLASLt wants the activation scales token-major (a column-major [M, K/128]), the
weight [N, K] as the column-major second operand (w.t()), and the weight's block scales [N/128, K/128]
with K/128 padded to a multiple of 4, passed transposed. `block_scales` recovers [N/128, K/128] from the
canonical row-repeated scale; `probe` runs one small product at load so a torch or cuBLAS without this
GEMM falls back to weight-only instead of failing mid-serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.quantization.fp8_weight import FP8, FP8_MAX, Fp8Weight

BLOCK = 128


def block_scales(weight: Fp8Weight) -> torch.Tensor | None:
    """[N/128, K/128] float32 when the weight is 128 x 128 blocks whose scale rows repeat per 128 rows
    (a fused layer whose shards start and end on block edges), else None."""
    n, k = weight.data.shape
    if weight.group_k != BLOCK or n % BLOCK or k % BLOCK:
        return None
    scale = weight.scale.view(n // BLOCK, BLOCK, k // BLOCK)
    first = scale[:, :1]
    if not torch.equal(scale, first.expand_as(scale)):
        return None
    return first.squeeze(1).contiguous()


def padded_weight_scales(scales: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] -> [N/128, K/128 rounded up to 4] (zero-padded): cuBLASLt's layout."""
    pad = -scales.shape[1] % 4
    return F.pad(scales, (0, pad)) if pad else scales.contiguous()


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, K/128], token-major in memory): on CUDA one Triton
    launch (kernels/fp8_quant.py), else torch ops (the reference it is tested against)."""
    if x.is_cuda and x.stride(-1) == 1:
        from fitserve.kernels.fp8_quant import quantize_groups

        return quantize_groups(x)
    return quantize_activation_groups_reference(x)


def quantize_activation_groups_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation_groups in torch ops."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    scale = groups.abs().amax(dim=-1).div_(FP8_MAX).clamp_(min=1e-12)
    quantized = (groups / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return quantized, scale.t().contiguous().t()


class Fp8BlockW8A8Method:
    path = "w8a8-block"

    def __init__(self, decode_kernel: bool = False) -> None:
        self.decode_kernel = decode_kernel  # up to 16 rows through kernels/fp8_w8a16.py (fp8_compute.py)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        if self.decode_kernel:
            from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear, w8a16_rows_ok

            if w8a16_rows_ok(rows):
                out = fp8_w8a16_linear(rows, layer.fp8_weight, layer.fp8_scale, counters=layer.fp8_counters)
                if layer.bias is not None:
                    out = out + layer.bias.to(out.dtype)
                return out.view(*x.shape[:-1], out.shape[-1])
        if m % 4:
            rows = F.pad(rows, (0, 0, 0, -m % 4))
        x_q, x_scale = quantize_activation_groups(rows)
        scales = layer.fp8_block_scale  # [N/128, padded K/128]
        out = F.scaled_mm(
            x_q,
            layer.fp8_weight.t(),
            x_scale,
            F.ScalingType.BlockWise1x128,
            scales.t(),
            F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )[:m]
        if layer.bias is not None:
            out = out + layer.bias.to(out.dtype)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def probe(device: torch.device) -> str | None:
    """None when the block-scaled GEMM runs here, else torch's message (checked once per device)."""
    key = str(device)
    if key not in _probed:
        layer = nn.Module()
        layer.bias = None
        layer.fp8_weight = torch.zeros((BLOCK, BLOCK), dtype=FP8, device=device)
        layer.fp8_block_scale = padded_weight_scales(torch.ones((1, 1), device=device))
        try:
            Fp8BlockW8A8Method().apply(layer, torch.ones((1, BLOCK), dtype=torch.bfloat16, device=device))
            _probed[key] = None
        except (RuntimeError, NotImplementedError, ValueError) as error:
            _probed[key] = str(error).splitlines()[0][:200]
    return _probed[key]


_probed: dict[str, str | None] = {}
