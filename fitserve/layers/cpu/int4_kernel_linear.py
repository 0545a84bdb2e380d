"""CPU linear layers of 4-bit groups multiplied by fitserve's C kernel (c_kernels/int4_gemm.c).

Preferred over torch's int4 kernel (int4_linear.py) wherever the C kernel builds (x86-64 with
AVX-512 VNNI, AVX-VNNI or AVX2 + FMA, and a C compiler): a matrix of 4-bit groups (a converted Q4_1
GGUF's, found by `find_int4_groups`) is packed once as codes plus a float16 step and minimum per group
of 32, and every call, whatever its rows, runs the kernel on float32 activations: no bf16 conversions
around it, no float16 copy of the weight for long calls (the copy cost 2 bytes per weight, 212 MB for
SmolLM2-135M).

What it computes: the exact product of the packed weights with the activations rounded per group of 32
to two int8 levels (int4_gemm.c's header says how), summed in int32 per group and in float32 across
groups: ~2e-5 relative from the float32 product on the default model's layers (torch's kernel: ~0.3%,
from bf16 activations and scales; docs/engine.md, "fitserve's C kernels").

Its time per call against torch's kernel and the float16 copy: docs/performance.md, section "On the CPU".

FITSERVE_CPU_KERNELS=0 uses torch's kernel instead; FITSERVE_CPU_INT4=0 keeps every matrix float.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fitserve.layers.cpu.c_kernels.int4_gemm import BoundInt4Gemm
from fitserve.layers.cpu.c_kernels.library import KernelSet, load_cpu_kernels
from fitserve.layers.cpu.int4_linear import INT4_TOLERANCE, packable_shape

logger = logging.getLogger("fitserve")

_announced = False


class Int4KernelCpuLinearMethod:
    """Applies a layer whose `weight` is the kernel's packed codes and `int4_scales` their groups', through
    the kernel bound to them (`gemm`)."""

    def __init__(self, gemm: BoundInt4Gemm) -> None:
        self.gemm = gemm

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        raise TypeError(
            "Int4KernelCpuLinearMethod packs loaded weights (convert_for_kernel); it creates none"
        )

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Kept lean (every projection of every decode step): the usual call, float32 rows with a float32
        # bias or none, goes straight to the kernel.
        bias = layer.bias
        plain_bias = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        if x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and plain_bias:
            return self.gemm(x, bias)
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != torch.float32 or flat.stride(-1) != 1:
            flat = flat.float().contiguous()
        out = self.gemm(flat)
        if bias is not None:
            out += bias
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])


def convert_for_kernel(layer: nn.Module, values: torch.Tensor) -> Int4KernelCpuLinearMethod | None:
    """Packs `layer.weight`, whose values are `values` (the weight itself, or its bfloat16 checkpoint
    tensor), for the C kernel when the kernel is available here and the weight is 4-bit groups that
    float16 steps and minimums reproduce; returns the layer's new method, or None."""
    kernels = load_cpu_kernels()
    if kernels is None or not packable_shape(values, stored_as="kernel"):
        return None
    if values.dtype not in (torch.float32, torch.bfloat16):
        values = values.float()
    # The C packer finds and packs the groups in one pass (int4_pack.c); torch's find_int4_groups and
    # pack_for_kernel compute the same bytes in about a dozen.
    packed = kernels.int4_pack(values, INT4_TOLERANCE)
    if packed is None:
        return None
    out_features, in_features = layer.weight.shape
    layer.weight = nn.Parameter(packed.codes, requires_grad=False)
    layer.register_buffer("int4_scales", packed.scales, persistent=False)
    _announce(packed.max_deviation, kernels.kernel_set)
    logger.debug(
        "%s: %d x %d weight kept as int4 for the C kernel (max deviation %.2g of a group's largest weight)",
        type(layer).__name__,
        out_features,
        in_features,
        packed.max_deviation,
    )
    return Int4KernelCpuLinearMethod(kernels.int4_gemm.bind(packed.codes, packed.scales, out_features))


def _announce(max_deviation: float, kernel_set: KernelSet) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    logger.info(
        "CPU weights: matrices that are 4-bit groups of 32 (a Q4_1 GGUF's, converted) stay int4 (0.5 byte "
        "per weight + float16 step and minimum per group; first matrix reproduced within %.2g of its groups' "
        "largest weight), multiplied by fitserve's C kernel, kernel set %s (%s; activations rounded to two "
        "int8 levels per group); FITSERVE_CPU_KERNELS=0 uses torch's int4 kernel instead",
        max_deviation,
        kernel_set.name,
        kernel_set.description,
    )
