"""An Int4Weight made runnable, once, at load: the forms a quantized layer computes with.

On the CPU, in this order of preference:
- fitserve's C int4 kernel (layers/cpu/int4_kernel_linear.py) where it builds, for group sizes that are a
  multiple of 32 (per-channel included when K is) and N a multiple of 16: each group's scale becomes the
  kernel's float16 step and -z * scale its minimum, repeated over the group's runs of 32 columns;
- torch's CPU int4 kernel (layers/cpu/int4_linear.py, bf16 scales and zeros) for the same group sizes
  when N is a multiple of its row block;
- else the weight dequantized once to the model dtype.
On a GPU: fitserve's Triton int4 GEMM (kernels/int4_gemm.py), the weight repacked once into its layout
(kernels/int4_repack.py) for bfloat16 / float16 models and the group sizes it takes; else dequantized.
Act order (Int4Weight.perm) permutes the activations' columns before the product.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fitserve.layers.quantization.int4_weight import Int4Weight, dequantize
from fitserve.layers.quantization.placement import is_offloaded
from fitserve.layers.quantization.rows_split import Kernel, RowsSplitMethod

logger = logging.getLogger("fitserve")
KERNEL_GROUP = 32
# Rows of x up to which the GPU int4 path runs the fused W4A16 kernels (kernels/int4_gemm.py); past it,
# chunks of the weight dequantized into a shared scratch buffer and cuBLAS (kernels/int4_dequant.py).
# On the H100, Llama-3.1-8B's four layers at group 128 (benchmarks/results/h100_int4_gemm_paths.json): the
# four together take 389 us fused against 436 chunked at 128 rows, 543 against 486 at 256.
FUSED_MAX_ROWS = 128
_announced: set[str] = set()


class PermutedInputMethod:
    """Another int4 method applied to x[..., perm] (act order)."""

    def __init__(self, inner: Any, perm: torch.Tensor) -> None:
        self.inner = inner
        self.perm = perm

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x.index_select(-1, self.perm))


class Int4GpuLinearMethod(RowsSplitMethod):
    """The weight in the Triton int4 kernels' layout. Up to FUSED_MAX_ROWS rows of x (decode) the
    dequantize is fused into the GEMM (kernels/int4_gemm.py); more rows (prefill) take chunks of the
    weight's rows dequantized into a scratch buffer shared by every layer, each multiplied by cuBLAS into
    its columns of y (kernels/int4_dequant.py). That buffer (SCRATCH_BYTES per device and dtype) is
    allocated on first use, which is the engine's memory profiling run (a dummy step at
    max_num_batched_tokens, worker/model_runner.py profile_run): so it is allocated before the KV cache is
    sized and counted in the activation peak."""

    fused_max_rows = FUSED_MAX_ROWS

    def kernels(self) -> tuple[Kernel, Kernel]:
        from fitserve.kernels.int4_dequant import chunked_int4_linear
        from fitserve.kernels.int4_gemm import int4_linear

        return int4_linear, chunked_int4_linear


class DequantizedLinearMethod:
    """The weight dequantized once to the model dtype, multiplied densely."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from fitserve.layers.linear import dense_linear

        return dense_linear(x, layer.weight, layer.bias)


def make_runnable(
    layer: nn.Module,
    weight: Int4Weight,
    dtype: torch.dtype,
    what: str,
    device: torch.device | None = None,
    store_on: torch.device | None = None,
) -> tuple[Any, str]:
    """Stores `weight` (on any device) on `layer` in the form it computes with on `device` (default: the
    weight's), its tensors registered as the layer's buffers on `store_on` (default: `device`; the CPU
    for a GPU layer that --cpu-offload-gb keeps in CPU memory); returns (the method that applies it, the
    path's name: "triton-int4", "c-kernel", "torch-int4" or "dequantized")."""
    device = torch.device(device) if device is not None else weight.codes.device
    store_on = torch.device(store_on) if store_on is not None else device
    if device.type == "cpu" and weight.codes.device.type != "cpu":
        weight = weight.to(device)
    method, path = None, "dequantized"
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        method = _for_gpu_kernel(layer, weight, dtype, store_on)
        path = "triton-int4"
    elif device.type == "cpu" and weight.group_size % KERNEL_GROUP == 0:
        # The C kernel binds its tensors' addresses: not for a layer whose tensors the offload moves.
        method = None if is_offloaded(layer) else _for_c_kernel(layer, weight)
        path = "c-kernel"
        if method is None:
            method, path = _for_torch_kernel(layer, weight), "torch-int4"
    if method is None:
        path = "dequantized"
        values = dequantize(weight)  # original column order: no permutation needed
        layer.register_buffer("weight", values.to(dtype).to(store_on), persistent=False)
        method = DequantizedLinearMethod()
    elif weight.perm is not None:
        layer.register_buffer("int4_perm", weight.perm.to(store_on), persistent=False)
        method = PermutedInputMethod(method, layer.int4_perm)
    _announce(path, what, weight, dtype)
    return method, path


def _for_gpu_kernel(
    layer: nn.Module, weight: Int4Weight, dtype: torch.dtype, device: torch.device
) -> Any | None:
    from fitserve.kernels.int4_repack import check_group_size, repack_int4

    try:
        check_group_size(weight.in_features, weight.group_size)
    except ValueError:
        return None
    packed = repack_int4(weight.codes, weight.scales, weight.zeros, weight.group_size, dtype).to(device)
    # The layer owns the tensors (memory counts, --cpu-offload-gb moves them); the method reads the same
    # tensor objects, so whatever points them elsewhere (tensor.data = ...) moves both.
    for name in ("qweight", "scale_zero", "counters"):
        layer.register_buffer(f"int4_{name}", getattr(packed, name), persistent=False)
    return Int4GpuLinearMethod(packed)


def _scale_columns(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, minimum) float32 [N, K/32]: each group's scale and -z * scale, per run of 32 columns."""
    repeat = weight.group_size // KERNEL_GROUP
    scales = weight.scales.float()
    minimum = -weight.zeros.float() * scales
    return scales.repeat_interleave(repeat, dim=1), minimum.repeat_interleave(repeat, dim=1)


def _for_c_kernel(layer: nn.Module, weight: Int4Weight) -> Any | None:
    from fitserve.layers.cpu.c_kernels.int4_layout import kernel_shape_ok, pack_for_kernel
    from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels
    from fitserve.layers.cpu.int4_kernel_linear import Int4KernelCpuLinearMethod
    from fitserve.layers.cpu.int4_linear import cpu_int4_enabled

    if not cpu_int4_enabled() or not kernel_shape_ok(weight.out_features, weight.in_features):
        return None
    step, minimum = _scale_columns(weight)
    if max(float(step.abs().max()), float(minimum.abs().max())) > torch.finfo(torch.float16).max:
        return None
    kernels = load_cpu_kernels()
    if kernels is None:
        return None
    codes, scales = pack_for_kernel(weight.codes, step.half(), minimum.half())
    layer.register_buffer("int4_codes", codes, persistent=False)
    layer.register_buffer("int4_scales", scales, persistent=False)
    return Int4KernelCpuLinearMethod(kernels.int4_gemm.bind(codes, scales, weight.out_features))


def _for_torch_kernel(layer: nn.Module, weight: Int4Weight) -> Any | None:
    from fitserve.layers.cpu.int4_linear import (
        Int4CpuLinearMethod,
        cpu_int4_enabled,
        kernel_available,
        torch_block_rows,
    )

    if not cpu_int4_enabled() or not kernel_available():
        return None
    if weight.out_features % torch_block_rows() or weight.in_features % KERNEL_GROUP:
        return None
    step, minimum = _scale_columns(weight)
    # torch's convention: w = (code - 8) * scale + zero, so zero = minimum + 8 * scale
    scales_and_zeros = torch.stack((step, minimum + 8 * step), dim=-1).to(torch.bfloat16)
    packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
    layer.register_buffer("weight", packed, persistent=False)
    layer.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous(), persistent=False)
    layer.fp16_weight = None
    return Int4CpuLinearMethod()


def _announce(path: str, what: str, weight: Int4Weight, dtype: torch.dtype) -> None:
    key = f"{path}/{what}"
    if key in _announced:
        return
    _announced.add(key)
    how = {
        "c-kernel": "kept int4 for fitserve's C int4 kernel (float16 step and minimum per 32 columns)",
        "torch-int4": "kept int4 for torch's CPU int4 kernel (bf16 scale and zero per 32 columns)",
        "triton-int4": "kept int4, repacked for fitserve's Triton int4 GEMM (dequantize fused into it)",
        "dequantized": f"dequantized once at load to {str(dtype).removeprefix('torch.')} (no int4 kernel "
        f"here for group size {weight.group_size} on {weight.codes.device.type}); multiplied densely",
    }[path]
    logger.info("Quantized weights (%s): %s", what, how)
