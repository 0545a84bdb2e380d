"""An Fp8Weight made runnable, once, at load: the forms an fp8 layer computes with.

- "w8a8" (CUDA, compute capability >= 8.9, bfloat16 / float16 models, N and K multiples of 16):
  torch._scaled_mm with row-wise scales. Each call quantizes x to fp8 per token (dynamic: its row's
  amax / 448; static: the checkpoint's input_scale), then y = (x_q @ w_q^T) * x_scale * w_scale in
  bfloat16 (row-wise scales need a bfloat16 output). The weight is stored row-major [N, K] and passed as
  w.t(), the column-major [K, N] second operand _scaled_mm wants. Up to 16 rows (decode) take the W8A16
  kernel instead (kernels/fp8_w8a16.py: 1-byte weights streamed once, no activation quantization, no
  second launch): on the H100 the four Llama-3.1-8B layers at 1 row take 119 us that way (109 after the
  BLOCK_K 256 sweep), 140 through _scaled_mm, 165 in bf16 (benchmarks/results/h100_fp8_linear.json).
- "w8a8-block" (the same GPUs, 128 x 128 block scales, dynamic activations): fp8_block.py, activations
  quantized per token and 128 columns, the block scales as they are; up to 16 rows take the W8A16 kernel
  as "w8a8" does (on the H200, Qwen3-30B-A3B-FP8's attention projections at batch 1: 1.13 ms of a decode
  step through cuBLASLt's block-scaled GEMM plus 0.18 ms of activation quantization, against 0.85 ms).
- "weight-only" (every other case: weight-only checkpoints, the CPU, GPUs below 8.9, float32 models, odd
  shapes): the weight stays fp8 in memory (1 byte a weight plus the scales); each call dequantizes it a
  chunk of rows at a time to the activations' dtype and multiplies, so at most CHUNK_ELEMENTS dequantized
  values exist at once; on GPUs of 7.5 and up, up to 16 rows (decode) of bf16 / fp16 activations run
  kernels/fp8_w8a16.py instead, the dequantize inside the GEMM (below 8.9 from the weight's bytes).
  Activations are not quantized, so a W8A8 checkpoint runs weight-only here (logged once).
Tensors live on the layer as buffers (fp8_weight, fp8_scale, fp8_input_scale) so --cpu-offload-gb
moves them as it moves any buffer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fitserve.layers.quantization.fp8_weight import FP8, FP8_MAX, Fp8Weight, expand_scale, rows_per_chunk

logger = logging.getLogger("fitserve")
W8A8_MIN_CAPABILITY = (8, 9)
W8A8_DTYPES = (torch.bfloat16, torch.float16)  # model dtypes the W8A8 path serves
# dequantized elements at a time on the weight-only path: 4 Mi on the CPU (stays in cache-sized pieces),
# 64 Mi on a GPU (a few large GEMMs)
CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
_announced: set[str] = set()


def w8a8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= W8A8_MIN_CAPABILITY


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, 1]): per token (amax / 448), or the static scale. On
    CUDA one Triton launch (kernels/fp8_quant.py), else torch ops (the reference it is tested against)."""
    if x.is_cuda and x.stride(-1) == 1:
        from fitserve.kernels.fp8_quant import quantize_rows

        return quantize_rows(x, None if input_scale is None else input_scale.float().reshape(1))
    return quantize_activations_reference(x, input_scale)


def quantize_activations_reference(
    x: torch.Tensor, input_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations in torch ops."""
    if input_scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True).float().div_(FP8_MAX).clamp_(min=1e-12)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    quantized = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale.contiguous()


class Fp8W8A8Method:
    """Row-wise scaled fp8 GEMM (torch._scaled_mm); see the module doc."""

    path = "w8a8"

    def __init__(self, decode_kernel: bool = False) -> None:
        self.decode_kernel = decode_kernel  # up to 16 rows through kernels/fp8_w8a16.py (see module doc)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.decode_kernel:
            from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear, w8a16_rows_ok

            if w8a16_rows_ok(rows):
                scale = layer.fp8_scale_row.view(-1, 1)
                out = fp8_w8a16_linear(rows, layer.fp8_weight, scale, counters=layer.fp8_counters)
                if layer.bias is not None:
                    out = out + layer.bias.to(out.dtype)
                return out.view(*x.shape[:-1], out.shape[-1])
        x_q, x_scale = quantize_activations(rows, getattr(layer, "fp8_input_scale", None))
        # the second operand column-major: w [N, K] row-major, transposed (a view, no copy). CUDA's
        # row-wise scaling needs a bfloat16 output; torch's CPU kernel (tests) also gives float32.
        out_dtype = torch.bfloat16 if x.is_cuda else torch.float32
        out = torch._scaled_mm(
            x_q, layer.fp8_weight.t(), scale_a=x_scale, scale_b=layer.fp8_scale_row, out_dtype=out_dtype
        )
        if layer.bias is not None:
            out = out + layer.bias.to(out.dtype)
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


class Fp8WeightOnlyMethod:
    """The fp8 weight dequantized a chunk of rows at a time per call; see the module doc."""

    path = "weight-only"

    def __init__(self, group_k: int, decode_kernel: bool = False) -> None:
        self.group_k = group_k
        self.decode_kernel = decode_kernel  # few-row (decode) products through kernels/fp8_w8a16.py

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        data, scale = layer.fp8_weight, layer.fp8_scale
        rows = x.reshape(-1, x.shape[-1])
        n, k = data.shape
        if self.decode_kernel:
            from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear, w8a16_rows_ok

            if w8a16_rows_ok(rows):
                out = fp8_w8a16_linear(rows, data, scale, counters=layer.fp8_counters)
                if layer.bias is not None:
                    out = out + layer.bias.to(out.dtype)
                return out.view(*x.shape[:-1], n)
        step = rows_per_chunk(k, CHUNK_ELEMENTS.get(data.device.type, CHUNK_ELEMENTS["cuda"]))
        if step >= n:
            out = rows @ _dequantized(data, scale, self.group_k, rows.dtype).t()
        else:
            out = torch.empty((rows.shape[0], n), dtype=rows.dtype, device=rows.device)
            for start in range(0, n, step):
                stop = min(start + step, n)
                weight = _dequantized(data[start:stop], scale[start:stop], self.group_k, rows.dtype)
                torch.matmul(rows, weight.t(), out=out[:, start:stop])
        if layer.bias is not None:
            out = out + layer.bias.to(out.dtype)
        return out.view(*x.shape[:-1], n)


def _dequantized(data: torch.Tensor, scale: torch.Tensor, group_k: int, dtype: torch.dtype) -> torch.Tensor:
    values = data.to(torch.float32)
    values.mul_(expand_scale(scale, group_k, data.shape[1]))
    return values.to(dtype)


def make_fp8_runnable(
    layer: nn.Module,
    weight: Fp8Weight,
    input_scale: torch.Tensor | None,
    dtype: torch.dtype,
    activations: str,
    what: str,
    device: torch.device,
    store_on: torch.device | None = None,
) -> Any:
    """Stores `weight` on `layer` in the form it computes with on `device`, its tensors as the layer's
    buffers on `store_on` (default `device`; the CPU for a layer --cpu-offload-gb keeps there, whose
    buffers the offload copies in before each forward); returns the method."""
    weight.check()
    store_on = device if store_on is None else store_on
    n, k = weight.data.shape
    w8a8 = (
        activations != "none"
        and w8a8_supported(device)
        and dtype in W8A8_DTYPES
        and n % 16 == 0
        and k % 16 == 0
    )
    method: Any = None
    note = ""
    if w8a8 and weight.scale.shape[1] == 1:
        layer.register_buffer("fp8_weight", weight.data.to(store_on).contiguous(), persistent=False)
        scale_row = weight.scale.to(store_on).reshape(1, n).contiguous()
        layer.register_buffer("fp8_scale_row", scale_row, persistent=False)
        if activations == "static" and input_scale is not None:
            static = input_scale.float().reshape(1).to(store_on)
            layer.register_buffer("fp8_input_scale", static, persistent=False)
        method = Fp8W8A8Method(_w8a16_kernel_ok(device, weight))
    elif w8a8 and activations == "dynamic":
        method, note = _block_method(layer, weight, device, store_on)
    if method is None:
        layer.register_buffer("fp8_weight", weight.data.to(store_on), persistent=False)
        layer.register_buffer("fp8_scale", weight.scale.to(store_on), persistent=False)
        method = Fp8WeightOnlyMethod(weight.group_k, _w8a16_kernel_ok(device, weight))
        note = note or ("" if not w8a8 else "block scales other than 128 x 128 on whole blocks")
    if getattr(method, "decode_kernel", False):
        from fitserve.kernels.fp8_w8a16 import split_counters  # the decode kernel's split-K

        layer.register_buffer("fp8_counters", split_counters(n, store_on), persistent=False)
    _announce(method.path, what, activations, device, dtype, note)
    return method


def _w8a16_kernel_ok(device: torch.device, weight: Fp8Weight) -> bool:
    if device.type != "cuda":
        return False
    from fitserve.kernels.fp8_w8a16 import w8a16_layer_ok

    return w8a16_layer_ok(device, weight.group_k, weight.scale.shape[1])


def _block_method(
    layer: nn.Module, weight: Fp8Weight, device: torch.device, store_on: torch.device
) -> tuple[Any, str]:
    """The block-scaled W8A8 GEMM (fp8_block.py) when the weight's blocks and this torch allow it."""
    from fitserve.layers.quantization.fp8_block import (
        Fp8BlockW8A8Method,
        block_scales,
        padded_weight_scales,
        probe,
    )

    scales = block_scales(weight)
    if scales is None:
        return None, "block scales other than 128 x 128 on whole blocks"
    failed = probe(device)
    if failed is not None:
        return None, f"torch's block-scaled fp8 GEMM does not run here ({failed})"
    layer.register_buffer("fp8_weight", weight.data.to(store_on).contiguous(), persistent=False)
    layer.register_buffer("fp8_block_scale", padded_weight_scales(scales.to(store_on)), persistent=False)
    decode_kernel = _w8a16_kernel_ok(device, weight)
    if decode_kernel:  # the decode kernel reads the canonical [N, K / 128] scale
        layer.register_buffer("fp8_scale", weight.scale.to(store_on).contiguous(), persistent=False)
    return Fp8BlockW8A8Method(decode_kernel), ""


def _announce(
    path: str, what: str, activations: str, device: torch.device, dtype: torch.dtype, note: str = ""
) -> None:
    key = f"{path}/{what}/{activations}/{device.type}/{note}"
    if key in _announced:
        return
    _announced.add(key)
    if path == "w8a8":
        how = "fp8 W8A8 through torch._scaled_mm (per-token activation scales, per-channel weight scales)"
    elif path == "w8a8-block":
        how = "fp8 W8A8 through torch's block-scaled scaled_mm (1 x 128 activation, 128 x 128 weight scales)"
    else:
        how = (
            f"kept fp8 in memory (1 byte a weight + float32 scales), dequantized to "
            f"{str(dtype).removeprefix('torch.')} a chunk of rows per call (weight-only)"
        )
        if activations != "none":
            reason = (
                "the CPU"
                if device.type == "cpu"
                else note
                or f"this GPU (compute capability below {W8A8_MIN_CAPABILITY[0]}.{W8A8_MIN_CAPABILITY[1]}, "
                "or a float32 model, or a dim not a multiple of 16)"
            )
            kept = str(dtype).removeprefix("torch.")
            how += f"; W8A8 falls back to weight-only ({kept} activations) on {reason}"
    logger.info("Quantized weights (%s): %s", what, how)
