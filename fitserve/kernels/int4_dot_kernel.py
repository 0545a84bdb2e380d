"""The int4 GEMM's tensor-core kernel, `_int4_dot_kernel`: y = x @ W.T (+ bias) for a W4A16 weight in the
layout of kernels/int4_repack.py, for more rows than the CUDA-core kernel takes (kernels/int4_gemm.py
launches it for more rows than one; its helpers shared with the CUDA-core
kernel: kernels/int4_kernel_parts.py).

A program computes a [BLOCK_M, BLOCK_N] output tile, K in 256-code blocks. On GPUs (PAIRED) the block is
dequantized two slices at a time in packed 16-bit pairs, ~1.5 instructions a weight, each weight
(code - z) * s rounded once to x's dtype (kernels/int4_pair_dequant.py); under the interpreter, or with
zero points that are not small integers, each nibble j goes through float32 (w = q * s - z * s, rounded
to x's dtype, ~6 instructions a weight). Either way the [BLOCK_N, 32] slices feed tl.dot with depth 32
against the matching 32 columns of x, float32 accumulation. SWAP_AB computes the transposed tile
(acc[BLOCK_N, BLOCK_M] = W x.T, the weight on the MMA's long side, as kernels/swapped_gemm.py does),
which choose_config uses up to 128 rows, with split-K up to 64. Triton waits for each warpgroup MMA
before the next slice's dequantized weights may take its shared memory, so 8 dots of depth 32 a block
serialise dequantization and MMA 8 times. WIDE_K joins the block's 8 slices and reorders them into its
[BLOCK_N, 256] weights in natural K order (k = 32 j + i) for one dot of depth 256 against x's
contiguous [BLOCK_M, 256]: one wait a block. Row tiles are walked in groups of GROUP_M (an L2 swizzle).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.int4_kernel_parts import (
    _finish,
    _group_index,
    _load_scale_zero,
    _prefetch_split_rows,
    _unpack_nibble,
)
from fitserve.kernels.int4_pair_dequant import dequantize_pair, load_scale_zero_words, pack_pairs


@triton.jit
def _dequantize_slice(
    words, hi, kb, J: tl.constexpr, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype
):
    """Slice J of block kb (32 codes a row) as weights in x's dtype: [BLOCK_N, 32]."""
    s, z = _load_scale_zero(sz_ptr, _group_index(kb, J, group_size, GROUP_J), N, offs_n, n_mask)
    return tl.fma(_unpack_nibble(words, hi, J, magic), s[:, None], (-z * s)[:, None]).to(dtype)


@triton.jit
def _block_slices(words, hi, kb, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype):
    """The block's 8 slices (32 codes a row each) as [BLOCK_N, 32] weights in x's dtype, float32 route."""
    w0 = _dequantize_slice(words, hi, kb, 0, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w1 = _dequantize_slice(words, hi, kb, 1, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w2 = _dequantize_slice(words, hi, kb, 2, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w3 = _dequantize_slice(words, hi, kb, 3, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w4 = _dequantize_slice(words, hi, kb, 4, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w5 = _dequantize_slice(words, hi, kb, 5, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w6 = _dequantize_slice(words, hi, kb, 6, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w7 = _dequantize_slice(words, hi, kb, 7, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _pair_scales(sz_ptr, kb, P: tl.constexpr, group_size, N, offs_n, n_mask, GROUP_J: tl.constexpr, dtype):
    """The packed (scale, -(base + zero)) pairs of slices P and P + 4 (int4_pair_dequant.pack_pairs)."""
    low = load_scale_zero_words(sz_ptr, _group_index(kb, P, group_size, GROUP_J), N, offs_n, n_mask)
    high = load_scale_zero_words(sz_ptr, _group_index(kb, P + 4, group_size, GROUP_J), N, offs_n, n_mask)
    return pack_pairs(low, high, dtype)


@triton.jit
def _block_slices_paired(words, kb, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J: tl.constexpr, dtype):
    """The block's 8 slices as [BLOCK_N, 32] weights, two slices per packed-pair dequantization
    (kernels/int4_pair_dequant.py); groups of 128 codes or more load their scales once a block."""
    scale_pair, base_pair = _pair_scales(sz_ptr, kb, 0, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w0, w4 = dequantize_pair(words, 0, scale_pair, base_pair, dtype)
    if GROUP_J == 1:  # slices p and p + 4 start groups where p % GROUP_J == 0
        scale_pair, base_pair = _pair_scales(sz_ptr, kb, 1, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w1, w5 = dequantize_pair(words, 1, scale_pair, base_pair, dtype)
    if GROUP_J <= 2:
        scale_pair, base_pair = _pair_scales(sz_ptr, kb, 2, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w2, w6 = dequantize_pair(words, 2, scale_pair, base_pair, dtype)
    if GROUP_J == 1:
        scale_pair, base_pair = _pair_scales(sz_ptr, kb, 3, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w3, w7 = dequantize_pair(words, 3, scale_pair, base_pair, dtype)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _wide_block_dot(
    acc,
    slices,
    kb,
    x_ptr,
    offs_m,
    m_mask,
    stride_xm,
    K,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """acc += one whole block as a single tl.dot of depth 256 (instead of 8 of depth 32, each of which
    Triton waits for): the 8 slices are joined and reordered into the block's [BLOCK_N, 256] weights."""
    w0, w1, w2, w3, w4, w5, w6, w7 = slices
    # dims (n, i, b0, b1, b2) with slice j = b0 + 2 b1 + 4 b2; code k = 32 j + i wants (n, b2, b1, b0, i)
    joined = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)), tl.join(tl.join(w4, w5), tl.join(w6, w7)))
    block_n: tl.constexpr = w0.shape[0]
    w = tl.reshape(tl.permute(joined, (0, 4, 3, 2, 1)), (block_n, 256))
    offs_k = kb * 256 + tl.arange(0, 256)
    x_tile = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    if EVEN_K:
        x = tl.load(x_tile, mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_tile, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    return tl.dot(w, tl.trans(x), acc) if SWAP_AB else tl.dot(x, tl.trans(w), acc)


@triton.jit
def _slice_dot(acc, w, x_rows, k0, m_mask, offs_p, K, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += one slice's [BLOCK_N, 32] weights against x's 32 columns from k0 (a tl.dot of depth 32)."""
    if EVEN_K:
        xj = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)
    else:
        xj = tl.load(x_rows + k0, mask=m_mask[:, None] & ((k0 + offs_p) < K)[None, :], other=0.0)
    return tl.dot(w, tl.trans(xj), acc) if SWAP_AB else tl.dot(xj, tl.trans(w), acc)


@host_launched
@triton.jit(do_not_specialize=["M"])
def _int4_dot_kernel(
    x_ptr,
    qw_ptr,
    sz_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_ym,
    group_size,
    blocks_per_split,
    num_splits,
    magic,
    shift16,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_J: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    GROUP_M: tl.constexpr,
    WIDE_K: tl.constexpr,
    PAIRED: tl.constexpr,  # packed-pair dequantization (int4_pair_dequant.py): GPUs, small integer zeros
    NUM_STAGES: tl.constexpr,
    PREFETCH_BYTES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Row tiles in groups of GROUP_M walk the column tiles together, so a weight tile is read from HBM
    # about once per group and x's rows stay in L2.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_PDL and PREFETCH_BYTES > 0:
        _prefetch_split_rows(qw_ptr, offs_n, N, K, stride_qn, pid_k * blocks_per_split, PREFETCH_BYTES)
    wait_for_previous_kernel(USE_PDL)
    offs_p = tl.arange(0, 32)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_p[None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_p[None, :]
    num_blocks = tl.cdiv(K, 256)
    first = pid_k * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    dtype = x_ptr.dtype.element_ty
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(first, last, num_stages=NUM_STAGES):
        words = tl.load(w_rows + kb * 32, mask=n_mask[:, None], other=0)
        if WIDE_K:
            if PAIRED:
                slices = _block_slices_paired(
                    words, kb, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype
                )
            else:
                hi = words >> shift16  # runtime 16: a constant lets LLVM fold the shift into each mask
                slices = _block_slices(
                    words, hi, kb, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype
                )
            acc = _wide_block_dot(acc, slices, kb, x_ptr, offs_m, m_mask, stride_xm, K, EVEN_K, SWAP_AB)
        elif PAIRED:
            for p in tl.static_range(4):
                if p % GROUP_J == 0:  # slices p and p + 4 start groups (groups >= 128 codes: p = 0 only)
                    scale_pair, base_pair = _pair_scales(
                        sz_ptr, kb, p, group_size, N, offs_n, n_mask, GROUP_J, dtype
                    )
                low, high = dequantize_pair(words, p, scale_pair, base_pair, dtype)
                acc = _slice_dot(acc, low, x_rows, kb * 256 + p * 32, m_mask, offs_p, K, EVEN_K, SWAP_AB)
                acc = _slice_dot(
                    acc, high, x_rows, kb * 256 + p * 32 + 128, m_mask, offs_p, K, EVEN_K, SWAP_AB
                )
        else:
            hi = words >> shift16
            for j in tl.static_range(8):
                if j % GROUP_J == 0:  # a group (or for larger groups, the block) starts
                    s, z = _load_scale_zero(
                        sz_ptr, _group_index(kb, j, group_size, GROUP_J), N, offs_n, n_mask
                    )
                    b = -z * s
                w = tl.fma(_unpack_nibble(words, hi, j, magic), s[:, None], b[:, None]).to(dtype)
                acc = _slice_dot(acc, w, x_rows, kb * 256 + j * 32, m_mask, offs_p, K, EVEN_K, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
    _finish(
        acc,
        offs_m,
        offs_n,
        M,
        N,
        y_ptr,
        stride_ym,
        bias_ptr,
        part_ptr,
        counter_ptr + pid,
        pid_k,
        num_splits,
        HAS_BIAS,
        SPLIT,
    )
