"""Activations to fp8 (float8 e4m3) for the W8A8 GEMMs (layers/quantization/fp8_compute.py, fp8_block.py),
in one launch instead of the half-dozen elementwise ops of the torch form (fp8_compute.quantize_activations,
the reference these are tested against: the same scales and the same fp8 values).

- `quantize_rows(x, static)`: per token, scale = amax(|row|) * (1 / 448) (at least 1e-12), or the static
  per-tensor scale; q = clamp(x / scale, -448, 448) rounded to nearest even e4m3 (asked for explicitly:
  Triton's default fp8 downcast truncates). One program per row holds a row of up to 16,384 columns in
  registers (one read); longer rows are read twice (amax, then quantize).
- `quantize_groups(x)`: per token and 128 columns (the block-scaled GEMM's BlockWise1x128), scales
  written token-major ([M, K/128] with strides (1, M)), as cuBLASLt wants them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.fast_launch import INTERPRETING
from fitserve.kernels.fp8_bits import float32_to_e4m3_bits

FP8_MAX = 448.0
# amax * (1 / 448) rounded to float32: what torch's CUDA division by a scalar computes (the reference)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
ROW_BLOCK = 4096  # columns a step for rows longer than MAX_SINGLE
MAX_SINGLE = 16384  # rows up to this many columns are read once, whole, by one program
GROUP = 128


@triton.jit
def to_e4m3(quantized, EXACT_BITS: tl.constexpr):
    """float32 values within +-448 -> e4m3, rounded to nearest even. EXACT_BITS (the CPU interpreter,
    whose conversion loses a rounding carry into the exponent: 1.95 became 1.0) rounds with
    fp8_bits' integer operations instead: the same bytes as the GPU's conversion and torch's."""
    if EXACT_BITS:
        return float32_to_e4m3_bits(quantized).to(tl.float8e4nv, bitcast=True)
    return quantized.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    K,
    stride_x,
    stride_q,
    STATIC: tl.constexpr,
    SINGLE: tl.constexpr,
    EXACT_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if SINGLE:  # the whole row in registers: one read
        cols = tl.arange(0, BLOCK)
        values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            scale = tl.maximum(tl.max(tl.abs(values), axis=0) * INV_FP8_MAX, 1e-12)
        tl.store(scale_ptr + row, scale)
        quantized = tl.minimum(tl.maximum(tl.div_rn(values, scale), -448.0), 448.0)
        tl.store(
            q_ptr + row * stride_q + cols,
            to_e4m3(quantized, EXACT_BITS),
            mask=cols < K,
        )
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, K, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(values))
            scale = tl.maximum(tl.max(amax, axis=0) * INV_FP8_MAX, 1e-12)
        tl.store(scale_ptr + row, scale)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            quantized = tl.minimum(tl.maximum(tl.div_rn(values, scale), -448.0), 448.0)
            tl.store(
                q_ptr + row * stride_q + cols,
                to_e4m3(quantized, EXACT_BITS),
                mask=cols < K,
            )


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr, M, stride_x, stride_q, GROUP: tl.constexpr, EXACT_BITS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    cols = group * GROUP + tl.arange(0, GROUP)
    values = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(values), axis=0) * INV_FP8_MAX, 1e-12)
    tl.store(scale_ptr + group * M + row, scale)
    quantized = tl.minimum(tl.maximum(tl.div_rn(values, scale), -448.0), 448.0)
    tl.store(q_ptr + row * stride_q + cols, to_e4m3(quantized, EXACT_BITS))


def quantize_rows(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA, last dim contiguous) -> (fp8 [M, K], float32 scale [M, 1])."""
    m, k = x.shape
    quantized = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        static_arg = scale if static is None else static
        single = k <= MAX_SINGLE
        block = triton.next_power_of_2(k) if single else ROW_BLOCK
        _quantize_rows_kernel[(m,)](
            x,
            quantized,
            scale,
            static_arg,
            k,
            x.stride(0),
            k,
            STATIC=static is not None,
            SINGLE=single,
            EXACT_BITS=INTERPRETING,
            BLOCK=block,
            num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
        )
    return quantized, scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA, K a multiple of 128, last dim contiguous) -> (fp8 [M, K], float32 scale [M, K/128]
    token-major)."""
    m, k = x.shape
    quantized = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((k // GROUP, m), dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, k // GROUP)](
            x, quantized, scale, m, x.stride(0), k, GROUP=GROUP, EXACT_BITS=INTERPRETING
        )
    return quantized, scale.t()
