"""A bitsandbytes 4-bit layer's weight (bnb_weight.Nf4Weight) made runnable once at load; it stays 4-bit
in memory on every path.

- GPU, bfloat16 / float16 models: kernels/nf4_pack.PackedNf4 (codes as bitsandbytes packs them, one
  float16 absmax per block, the code table). Up to FUSED_MAX_ROWS rows of x the dequantize is fused
  into the GEMM (kernels/nf4_gemm.py); more rows (prefill) take chunks of the weight dequantized into the
  scratch buffer the int4 layers share, multiplied by cuBLAS (kernels/nf4_dequant.py).
- Elsewhere (the CPU, float32 models): each call dequantizes the weight in chunks of CPU_CHUNK_ROWS rows
  to x's dtype and multiplies each chunk into its columns of y; the 16-bit weight never exists whole.
  The absmax is kept in float16 here too where every block's fits (kernels/nf4_pack.scale_dtype), so
  both paths hold what the planner counts (layers/quantization/bnb_sizes.py).

The layer owns the tensors as non-persistent buffers (so the engine's memory count sees them); the method
reads the same tensor objects.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.quantization.bnb_weight import Nf4Weight
from fitserve.layers.quantization.rows_split import Kernel, RowsSplitMethod

logger = logging.getLogger("fitserve")
CPU_CHUNK_ROWS = 1024  # weight rows dequantized at once by the per-call path
# Rows of x up to which the GPU path runs the fused nf4 kernels; past it, chunked dequantize + cuBLAS. On
# the H100 (benchmarks/results/h100_nf4_gemm.json, Llama-3.1-8B qkv, block 64) the fused kernels take 15 us
# at 1 row, 40 at 16 and 91 at 32; the chunked path ~56 us from 16 to 128 rows and 72 at 512.
FUSED_MAX_ROWS = 16
_announced: set[str] = set()


class BnbGpuLinearMethod(RowsSplitMethod):
    path = "triton-nf4"
    fused_max_rows = FUSED_MAX_ROWS

    def kernels(self) -> tuple[Kernel, Kernel]:
        from fitserve.kernels.nf4_dequant import chunked_nf4_linear
        from fitserve.kernels.nf4_gemm import nf4_linear

        return nf4_linear, chunked_nf4_linear


class BnbDequantPerCallMethod:
    """y = x @ W.T with W dequantized chunk by chunk at every call (module docstring): each byte of codes
    becomes its two float32 values through kernels/nf4_pack.pair_table (one 8-byte index_select a byte:
    20x faster on 2 cores than an embedding lookup or two 16-entry lookups), each block is scaled by its
    absmax in place, then F.linear into the chunk's columns of y."""

    path = "dequantized-per-call"

    def __init__(self, weight: Nf4Weight) -> None:
        self.weight = weight
        from fitserve.kernels.nf4_pack import pair_table

        self.pairs = pair_table(weight.code).to(weight.packed.device)

    def dequantize_rows(self, part: slice, dtype: torch.dtype) -> torch.Tensor:
        weight = self.weight
        codes = weight.packed[part]
        pairs = torch.index_select(self.pairs, 0, codes.reshape(-1).int()).view(torch.float32)
        values = pairs.view(codes.shape[0], -1, weight.blocksize)
        values.mul_(weight.absmax[part].float().unsqueeze(-1))
        return values.view(codes.shape[0], -1).to(dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out_features = self.weight.out_features
        bias = layer.bias
        if out_features <= CPU_CHUNK_ROWS:
            out = F.linear(rows, self.dequantize_rows(slice(None), x.dtype), bias)
        else:
            out = torch.empty((rows.shape[0], out_features), dtype=x.dtype, device=x.device)
            for start in range(0, out_features, CPU_CHUNK_ROWS):
                part = slice(start, min(start + CPU_CHUNK_ROWS, out_features))
                chunk_bias = None if bias is None else bias[part]
                out[:, part] = F.linear(rows, self.dequantize_rows(part, x.dtype), chunk_bias)
        return out.view(*x.shape[:-1], out_features)


def make_bnb_runnable(
    layer: nn.Module,
    weight: Nf4Weight,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    store_on: torch.device | None = None,
) -> Any:
    """Stores `weight` on `layer` in the form it computes with on `device`, its tensors registered as the
    layer's buffers on `store_on` (default `device`; the CPU for a GPU layer --cpu-offload-gb keeps in CPU
    memory, whose buffers the offload copies in before each forward: placement.py); returns the method."""
    store_on = torch.device(store_on) if store_on is not None else torch.device(device)
    weight = weight.to(store_on)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        from fitserve.kernels.nf4_pack import pack_nf4

        packed = pack_nf4(weight.packed, weight.absmax, weight.code, weight.blocksize, dtype)
        for name in ("packed", "scales", "pair_table", "code", "permute_table", "mma_table", "counters"):
            layer.register_buffer(f"nf4_{name}", getattr(packed, name), persistent=False)
        method: Any = BnbGpuLinearMethod(packed)
    else:
        from fitserve.kernels.nf4_pack import scale_dtype

        absmax = weight.absmax.to(scale_dtype(weight.absmax))  # float16 where it holds every block's
        weight = Nf4Weight(weight.packed, absmax, weight.code, weight.blocksize, weight.quant_type)
        for name in ("packed", "absmax"):
            layer.register_buffer(f"nf4_{name}", getattr(weight, name), persistent=False)
        method = BnbDequantPerCallMethod(weight)
    _announce(method.path, what, weight)
    return method


def _announce(path: str, what: str, weight: Nf4Weight) -> None:
    key = f"{path}/{what}"
    if key in _announced:
        return
    _announced.add(key)
    how = {
        "triton-nf4": "kept 4-bit for fitserve's Triton nf4 GEMM (dequantize fused into it; float16 absmax "
        "per block)",
        "dequantized-per-call": "kept 4-bit; each call dequantizes it in chunks (no fused kernel on this "
        "device or dtype)",
    }[path]
    logger.info(
        "Quantized weights (%s, %s, blocks of %d): %s", what, weight.quant_type, weight.blocksize, how
    )
