"""bitsandbytes 4-bit weights (kernels/nf4_pack.PackedNf4) dequantized to bfloat16 / float16 rows, and the
chunked linear prefill steps run on them: chunks of W's rows dequantized into the scratch buffer every
int4 and nf4 layer shares (kernels/int4_dequant.scratch_buffer), each multiplied by cuBLAS straight into
its columns of y. Past a few dozen rows of x, a fused kernel dequantizes each weight tile once per row tile
of x; dequantizing W once a call (0.5 byte read, 2 bytes written a weight) then a bf16 GEMM wins.

`_nf4_dequantize_kernel`: a program owns BLOCK_N weight rows and BLOCK_K columns; it loads the rows'
bytes [BLOCK_N, BLOCK_K / 2], looks each up in the pair table (both codes' values at once), scales by the
block's absmax (BLOCK_K divides the block size: one a row) and stores the even and odd columns
interleaved (tl.join) as [BLOCK_N, BLOCK_K] contiguous values. No host sync, no allocation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fitserve.kernels.fast_launch import INTERPRETING
from fitserve.kernels.grid_math import cdiv
from fitserve.kernels.int4_dequant import chunk_rows, scratch_buffer
from fitserve.kernels.nf4_gemm import _pair_values, nf4_linear, supports
from fitserve.kernels.nf4_pack import PackedNf4

DEQUANT_BLOCK_N = 32
DEQUANT_MAX_BLOCK_K = 256


@triton.jit(do_not_specialize=["row_start", "row_count"])
def _nf4_dequantize_kernel(
    w_ptr,
    s_ptr,
    table_ptr,
    out_ptr,
    row_start,
    row_count,
    K,
    stride_out,
    blocksize,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = BLOCK_K // 2
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = local < row_count
    rows = (row_start + local).to(tl.int64)
    byte_at = pid_k * HALF + tl.arange(0, HALF)
    codes = tl.load(w_ptr + rows[:, None] * (K // 2) + byte_at[None, :], mask=in_rows[:, None], other=0)
    even, odd = _pair_values(codes, table_ptr)
    scale = tl.load(s_ptr + rows * (K // blocksize) + (pid_k * BLOCK_K) // blocksize, mask=in_rows, other=0.0)
    scale = scale.to(tl.float32)[:, None]
    values = tl.reshape(tl.join(even * scale, odd * scale), (BLOCK_N, BLOCK_K))
    columns = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    out = out_ptr + local.to(tl.int64)[:, None] * stride_out + columns[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=in_rows[:, None])


def dequantize_rows(packed: PackedNf4, row_start: int, row_count: int, out: torch.Tensor) -> torch.Tensor:
    """W[row_start : row_start + row_count] in out's dtype into out [row_count, K] (unit column stride)."""
    in_features = packed.in_features
    if not (
        row_start >= 0
        and row_start + row_count <= packed.out_features
        and tuple(out.shape) == (row_count, in_features)
        and out.device == packed.device
        and (out.stride(1) == 1 or row_count == 0)
    ):
        raise ValueError(
            f"dequantize_rows writes rows [{row_start}, {row_start + row_count}) of a "
            f"[{packed.out_features}, {in_features}] weight into out [{row_count}, {in_features}] on "
            f"{packed.device}; got out {tuple(out.shape)} on {out.device} (stride {out.stride()})"
        )
    if row_count == 0:
        return out
    block_k = min(packed.blocksize, DEQUANT_MAX_BLOCK_K)
    grid = (cdiv(row_count, DEQUANT_BLOCK_N), in_features // block_k)
    args = (packed.packed, packed.scales, packed.pair_table, out, row_start, row_count, in_features)
    options = {} if INTERPRETING else {"num_warps": 4}
    _nf4_dequantize_kernel[grid](
        *args, out.stride(0), packed.blocksize, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=block_k, **options
    )
    return out


def chunked_nf4_linear(
    x: torch.Tensor, packed: PackedNf4, bias: torch.Tensor | None = None, scratch_bytes: int | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> y [M, N] in x's dtype, by chunks of W's rows dequantized into the shared
    scratch buffer and multiplied by cuBLAS; nf4_linear where not even 128 rows fit."""
    if not supports(x, packed):
        raise ValueError(
            f"chunked_nf4_linear takes x [M, {packed.in_features}] in {packed.dtype} on {packed.device}; got "
            f"x {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    out_features, in_features = packed.out_features, packed.in_features
    scratch = scratch_buffer(x.device, x.dtype)
    usable = scratch.numel() * scratch.element_size()
    chunk = chunk_rows(out_features, in_features, x.element_size(), min(usable, scratch_bytes or usable))
    if chunk == 0 or x.shape[0] == 0:
        return nf4_linear(x, packed, bias)
    if chunk >= out_features:
        whole = scratch[: out_features * in_features].view(out_features, in_features)
        return F.linear(x, dequantize_rows(packed, 0, out_features, whole), bias)
    y = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    for start in range(0, out_features, chunk):
        count = min(chunk, out_features - start)
        weight = dequantize_rows(
            packed, start, count, scratch[: count * in_features].view(count, in_features)
        )
        columns = y[:, start : start + count]
        if bias is None:
            torch.mm(x, weight.t(), out=columns)
        else:
            torch.addmm(bias[start : start + count], x, weight.t(), out=columns)
    return y
