"""CPU linear layers whose weights are 4-bit groups: kept as int4 and multiplied by torch's int4 kernel.

A checkpoint converted from a 4-bit GGUF (Q4_1: the default SmolLM2 model) holds, in every run of 32
weights along a row, at most 16 evenly spaced values: w = m + d * q with q in 0..15, where m is the
group's smallest weight and m + 15 d its largest. `find_int4_groups` recovers (q, d, m) from the loaded
matrix and checks that they reproduce every weight; only then is the matrix packed, so any other
matrix (an fp32 or bf16 checkpoint, random test weights) is never touched.

The packed weight is 0.5 byte per weight plus a bfloat16 scale and zero per group, against 4 bytes
in float32: a decode step reads ~8x fewer weight bytes. The kernel (`torch._weight_int4pack_mm_for_cpu`)
computes in bfloat16 (bf16 activations in, fp32 accumulation, bf16 out): the AVX-512 kernel exists
only for bf16. Its scales and zeros are bf16 too, so a weight is reproduced within bf16 rounding of
its group's scale and zero (the largest deviation is logged). Without the float16 copy below, from
`DEQUANT_MIN_ROWS` rows on (long prefill chunks) the kernel is slower than float32 GEMM, so the
weight is dequantized to float32 for that call and multiplied densely, in float32.

From `FP16_MIN_ROWS` rows on (a decode step of 9 or more sequences, prefill chunks) the kernel's cost
grows with the rows (it dequantizes the weights again for every 4 rows), so each packed layer also keeps
a float16 copy of its loaded weight, prepacked for fbgemm's fp16 GEMM (float32 activations in and out,
float32 compute), and such calls multiply that instead. float16 rounds each loaded weight by at most
2^-11 of its magnitude, far less than the int4 form's bf16 scales (see above); the copy costs 2 bytes per
weight on top of the int4 form's ~0.6 (212 MB for SmolLM2-135M). FITSERVE_CPU_INT4_FP16=0 keeps no copy
(then long calls dequantize to float32 as before, and short ones stay on the kernel).

Packed layout (torch's CPU int4 layout; `dequantize_transposed` reads it back, a unit test pins it): uint8
[N, K/2] viewed as [N/B, K, B/2]: byte j of row k in block b holds q[B b + j, k] in its low nibble
and q[B b + B/2 + j, k] in its high nibble. B is 64 where torch's kernels are built for AVX-512 and 32
on AVX2-only CPUs (an AMD EPYC without AVX-512, for one); `torch_block_rows` finds it by packing a
probe matrix once.

Set FITSERVE_CPU_INT4=0 to keep every matrix as loaded.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fitserve.layers.cpu.c_kernels.int4_layout import BLOCK_COLUMNS as KERNEL_BLOCK_COLUMNS
from fitserve.layers.cpu.fp16_matmul import fp16_linear_op, prepack_fp16

logger = logging.getLogger("fitserve")

GROUP_SIZE = 32
# A matrix is packed only if every weight is reproduced within this fraction of its group's largest
# |weight|. A bf16-stored Q4 weight deviates by up to ~1/128 (bf16 rounding of the weight, its group's
# scale and zero); a matrix that is not 4-bit groups has ~30 free values per group, each landing this
# close to the grid with probability ~0.2, so it passes with probability ~1e-20 per group.
INT4_TOLERANCE = 2.0**-6
# Rows (tokens) from which a call dequantizes to float32 and runs the dense GEMM instead of the kernel.
DEQUANT_MIN_ROWS = 128
ENV_SWITCH = "FITSERVE_CPU_INT4"
# Rows from which a call multiplies the layer's float16 copy (fbgemm) instead of running the int4 kernel:
# from 9 rows the copy was faster (docs/performance.md, section "On the CPU").
FP16_MIN_ROWS = 9
FP16_ENV_SWITCH = "FITSERVE_CPU_INT4_FP16"

_announced = False


def cpu_int4_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def fp16_copy_enabled() -> bool:
    return os.environ.get(FP16_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def torch_block_rows() -> int:
    """Output rows per block of torch's packed int4 layout on this CPU (64 or 32, see above): the block
    size under which a probe matrix of distinct codes reads back as packed."""
    rows, cols = 128, GROUP_SIZE
    codes = (torch.arange(rows * cols, dtype=torch.int32).view(rows, cols) * 7) % 16
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block in (64, 32, 16):
        read = _unpack_blocks(packed, block, rows, cols)
        if torch.equal(read.permute(0, 2, 1).reshape(rows, cols), codes.to(torch.uint8)):
            return block
    raise RuntimeError(
        "torch's CPU int4 packing has a layout fitserve does not know (blocks of 64, 32 or 16 rows): "
        f"set {ENV_SWITCH}=0 to keep 4-bit matrices as loaded"
    )


def _unpack_blocks(packed: torch.Tensor, block: int, rows: int, cols: int) -> torch.Tensor:
    """Codes uint8 [rows / block, cols, block] of a packed uint8 [rows, cols / 2] in blocks of `block`
    rows."""
    blocks = packed.view(rows // block, cols, block // 2)
    return torch.cat((blocks & 0xF, blocks >> 4), dim=-1)


def kernel_available() -> bool:
    return all(
        hasattr(torch, name)
        for name in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
    )


@dataclass
class Int4Groups:
    """w[n, g * 32 + i] = codes[n, g * 32 + i] * step[n, g] + low[n, g], as recovered (float32)."""

    codes: torch.Tensor  # int32 [N, K], 0..15
    step: torch.Tensor  # float32 [N, K / 32]
    low: torch.Tensor  # float32 [N, K / 32]
    max_deviation: float  # largest |stored form - loaded| / the group's largest |weight|

    def torch_scales_and_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 (scales, zeros) in torch's convention: w = (code - 8) * scale + zero."""
        return self.step.to(torch.bfloat16), (self.low + 8 * self.step).to(torch.bfloat16)


def packable_shape(weight: torch.Tensor, stored_as: str = "torch") -> bool:
    rows_multiple = torch_block_rows() if stored_as == "torch" else KERNEL_BLOCK_COLUMNS
    return weight.dim() == 2 and weight.shape[0] % rows_multiple == 0 and weight.shape[1] % GROUP_SIZE == 0


def find_int4_groups(weight: torch.Tensor, stored_as: str = "torch") -> Int4Groups | None:
    """The 4-bit groups `weight` [N, K] is made of, or None when it is not such a matrix.

    stored_as: the form whose rounding the check covers: "torch" (bf16 scale and zero, for torch's
    kernel) or "kernel" (float16 step and minimum, for fitserve's C kernel, int4_gemm.c)."""
    if not packable_shape(weight, stored_as) or not weight.is_floating_point():
        return None
    rows, cols = weight.shape
    groups = weight.detach().float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    step = (high - low) / 15
    safe_step = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((groups - low) / safe_step).round_().clamp_(0, 15)
    found = Int4Groups(codes=codes, step=step.squeeze(-1), low=low.squeeze(-1), max_deviation=0.0)
    if stored_as == "torch":
        scales, zeros = found.torch_scales_and_zeros()
        dequantized = (codes - 8) * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)
    else:
        dequantized = codes * step.half().float() + low.half().float()
    magnitude = torch.maximum(low.abs(), high.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    deviation = float(((dequantized - groups).abs() / magnitude).max())
    if not deviation <= INT4_TOLERANCE:  # also refuses NaN
        return None
    found.codes = codes.reshape(rows, cols).to(torch.int32)
    found.max_deviation = deviation
    return found


def pack(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], scales_and_zeros bf16 [K/32, N, 2]) for torch's int4 kernel."""
    packed = torch._convert_weight_to_int4pack_for_cpu(groups.codes, 1)
    scales, zeros = groups.torch_scales_and_zeros()
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


def dequantize_transposed(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 weight, transposed: [K, N], as the kernel dequantizes it (to float32 rounding).

    `out` (float32, at least K * N elements) is written and returned instead of a new tensor.
    """
    num_groups, out_features, _ = scales_and_zeros.shape
    in_features = num_groups * GROUP_SIZE
    block = torch_block_rows()
    codes = _unpack_blocks(packed, block, out_features, in_features)  # [N/B, K, B]
    numel = in_features * out_features
    weight = torch.empty(numel) if out is None else out[:numel]
    # One pass converts to float32 and moves to k-major order ([K, N/B, B] is [K, N]).
    weight.view(in_features, out_features // block, block).copy_(codes.permute(1, 0, 2))
    scales = scales_and_zeros[..., 0].float().unsqueeze(1)
    offsets = scales_and_zeros[..., 1].float().unsqueeze(1) - 8 * scales  # w = code * scale + offset
    weight.view(num_groups, GROUP_SIZE, out_features).mul_(scales).add_(offsets)
    return weight.view(in_features, out_features)


class _Scratch(threading.local):
    """One float32 buffer per thread for the dequantized weight of a long call, grown as needed and
    reused by every layer: a fresh multi-megabyte tensor per call costs more in page faults than the
    dequantization itself."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def get(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel)
        return self.buffer


_scratch = _Scratch()


class Int4CpuLinearMethod:
    """Applies a layer whose `weight` is the packed int4 matrix and `scales_and_zeros` its groups'."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        raise TypeError("Int4CpuLinearMethod packs loaded weights (convert_to_int4); it creates none")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Kept lean: it runs for every projection of every decode step (a call that changes nothing, like
        # .to() to the dtype a tensor has, still costs ~1-2 us, and there are 120 projections a step).
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        fp32 = flat.dtype == torch.float32
        if rows >= FP16_MIN_ROWS and layer.fp16_weight is not None:
            if not (fp32 and flat.is_contiguous()):
                flat = flat.float().contiguous()
            out = fp16_linear_op()(flat, layer.fp16_weight)
            if not fp32:
                out = out.to(x.dtype)
        elif rows < DEQUANT_MIN_ROWS:
            out = torch._weight_int4pack_mm_for_cpu(
                flat.to(torch.bfloat16).contiguous(), layer.weight, GROUP_SIZE, layer.scales_and_zeros
            ).to(x.dtype)
        else:
            buffer = _scratch.get(layer.weight.numel() * 2)
            weight_t = dequantize_transposed(layer.weight, layer.scales_and_zeros, out=buffer)
            out = torch.mm(flat.float(), weight_t).to(x.dtype)
        if layer.bias is not None:
            out += layer.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def pack_fp16_copy(weight: torch.Tensor) -> Any | None:
    """`weight` [N, K] rounded to float16 and prepacked for fbgemm's fp16 GEMM; None when switched off
    (FITSERVE_CPU_INT4_FP16=0) or fbgemm is not available."""
    if not fp16_copy_enabled() or "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    return prepack_fp16(weight)


def convert_to_int4(layer: nn.Module, source: torch.Tensor | None = None) -> Any | None:
    """Packs `layer.weight` (a float matrix just loaded on the CPU) as int4 when it is 4-bit groups, for
    fitserve's C kernel where it builds on this machine (int4_kernel_linear.py), else for torch's.
    `source`: the weight's values as loaded (a bfloat16 checkpoint's), when they were not copied into
    `layer.weight` (linear.LinearBase._holds).

    Returns the linear method the layer now needs, or None when the weight was left as it is.
    """
    if not cpu_int4_enabled():
        return None
    from fitserve.layers.cpu.int4_kernel_linear import convert_for_kernel

    values = layer.weight if source is None else source
    method = convert_for_kernel(layer, values)
    if method is not None or not kernel_available():
        return method
    groups = find_int4_groups(values)
    if groups is None:
        return None
    fp16_weight = pack_fp16_copy(values)  # from the loaded values, before they are replaced
    packed, scales_and_zeros = pack(groups)
    # Memory outside parameters and buffers, for the loading log (ModelRunner counts it).
    layer.packed_copy_bytes = layer.weight.numel() * 2 if fp16_weight is not None else 0
    layer.weight = nn.Parameter(packed, requires_grad=False)
    layer.fp16_weight = fp16_weight
    layer.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
    _announce(groups.max_deviation, fp16_weight is not None)
    logger.debug(
        "%s: %d x %d weight kept as int4 (max deviation %.2g of a group's largest weight)",
        type(layer).__name__,
        packed.shape[0],
        packed.shape[1] * 2,
        groups.max_deviation,
    )
    return Int4CpuLinearMethod()


def _announce(max_deviation: float, fp16_copy: bool) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    logger.info(
        "CPU weights: matrices that are 4-bit groups of %d (a Q4_1 GGUF's, converted) stay int4 "
        "(0.5 byte per weight + bf16 scale and zero per group; first matrix reproduced within %.2g of its "
        "groups' largest weight), multiplied in bfloat16 (%s); %s=0 keeps them float",
        GROUP_SIZE,
        max_deviation,
        f"from {FP16_MIN_ROWS} tokens per step, a float16 copy of each (2 bytes per weight more) in "
        f"float32; {FP16_ENV_SWITCH}=0 keeps no copy"
        if fp16_copy
        else f"float32 from {DEQUANT_MIN_ROWS} tokens per step",
        ENV_SWITCH,
    )
