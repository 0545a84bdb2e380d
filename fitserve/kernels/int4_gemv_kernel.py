"""The int4 GEMM's CUDA-core kernel, `_int4_gemv_kernel`: y = x @ W.T (+ bias) for a W4A16 weight in the
layout of kernels/int4_repack.py, for the few rows of a batch-1 decode (kernels/int4_gemm.py launches it
for M <= GEMV_MAX_ROWS; its helpers shared with the tensor-core kernel: kernels/int4_kernel_parts.py).

A program owns BLOCK_N weight rows and a range of 256-code blocks of K (split-K, so that small layers
still give every SM several programs). Per block it loads a [BLOCK_N, 32] tile of words (one 128-byte
line per row; Triton's pipeliner copies it, and the group's scale / zero pairs, NUM_STAGES blocks
ahead) and, for each nibble j, turns the codes into exact float32 with one AND+OR (a LOP3: the code's
bits under the exponent of 2**23; MAGIC is a kernel argument so that ptxas fuses the two) and one FMA
that subtracts 2**23 and the zero point and undoes the nibble's 16**(j % 4) position (words >> 16 once
gives nibbles 4..7; the 16 is a runtime argument too, else LLVM folds the shift into every nibble),
then one FMA with x into a float32 [BLOCK_N, 32] partial. At the end of a group the partial is scaled
into the accumulator (acc += s * partial, elementwise: no shuffles in the loop); the columns are summed
once, after it. x is read as int32 pairs against the tile's even and odd columns, so a value is widened
with one instruction. In the sm_90 SASS (compiled here, no GPU) the loop costs ~4.4 instructions per
weight at BLOCK_N 64 on 2 warps (3 of them the LOP3 and the two FMAs): an H100 streaming 3.35 TB/s of
4-bit weights must retire 25.6 weights per SM per clock (1.98 GHz) of its 128 instruction slots, so the
kernel is near the issue limit and the H100 sweep decides how close to the bandwidth it gets. Zero
points that are not integers (PackedInt4.integer_zeros False) take the slower form
acc += s * (partial - z * sum x).
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
    _unpack_nibble_minus,
)


@triton.jit
def _gemv_one_row(
    x_row,
    w_rows,
    sz_ptr,
    K,
    N,
    group_size,
    magic,
    shift16,
    first,
    last,
    offs_n,
    offs_p,
    n_mask,
    BLOCK_N: tl.constexpr,
    GROUP_J: tl.constexpr,
    INT_ZEROS: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """x[0] @ W.T over blocks first..last-1 for BLOCK_N weight rows: float32 [BLOCK_N].

    The 32 columns of a block's word tile are taken as 16 even and 16 odd ones, so x can be read as
    int32 pairs (x[k], x[k + 1]) and widened with one instruction per value."""
    # Per weight row and column of the tile: sum over groups of s * sum_k x (q - z). Summed over the
    # tile's columns once, after the loop: no shuffles inside it.
    acc_even = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    x_pairs = x_row.to(tl.pointer_type(tl.int32)) + tl.arange(0, 16)
    for kb in tl.range(first, last, num_stages=NUM_STAGES):
        words = tl.load(w_rows + kb * 32, mask=n_mask[:, None], other=0)
        even, odd = tl.split(tl.reshape(words, (BLOCK_N, 16, 2)))
        # a runtime 16: with a constant, LLVM folds the shift into each nibble's mask (two instructions)
        even_hi = even >> shift16
        odd_hi = odd >> shift16
        part_even = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        part_odd = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        xsum_even = tl.zeros((16,), dtype=tl.float32)
        xsum_odd = tl.zeros((16,), dtype=tl.float32)
        for j in tl.static_range(8):
            k0 = kb * 256 + j * 32
            if j % GROUP_J == 0:  # a group (for groups over 256 codes: this block of it) starts
                s, z = _load_scale_zero(sz_ptr, _group_index(kb, j, group_size, GROUP_J), N, offs_n, n_mask)
            x_even, x_odd = _load_x_pairs(x_pairs, k0, K, x_row.dtype.element_ty, EVEN_K)
            if INT_ZEROS:
                code_even = _unpack_nibble_minus(even, even_hi, j, magic, z[:, None])
                code_odd = _unpack_nibble_minus(odd, odd_hi, j, magic, z[:, None])
            else:
                code_even = _unpack_nibble(even, even_hi, j, magic)
                code_odd = _unpack_nibble(odd, odd_hi, j, magic)
                xsum_even += x_even
                xsum_odd += x_odd
            part_even += code_even * x_even[None, :]
            part_odd += code_odd * x_odd[None, :]
            if (j + 1) % GROUP_J == 0:
                if INT_ZEROS:
                    acc_even += s[:, None] * part_even
                    acc_odd += s[:, None] * part_odd
                else:
                    acc_even += s[:, None] * (part_even - z[:, None] * xsum_even[None, :])
                    acc_odd += s[:, None] * (part_odd - z[:, None] * xsum_odd[None, :])
                    xsum_even = tl.zeros((16,), dtype=tl.float32)
                    xsum_odd = tl.zeros((16,), dtype=tl.float32)
                part_even = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
                part_odd = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    return tl.sum(acc_even + acc_odd, axis=1)


@triton.jit
def _load_x_pairs(x_pairs, k0, K, X_DTYPE: tl.constexpr, EVEN_K: tl.constexpr):
    """x[k0 + 2t] and x[k0 + 2t + 1] for t < 16 as float32, from 16 int32 loads."""
    if EVEN_K:
        pairs = tl.load(x_pairs + k0 // 2)
    else:
        pairs = tl.load(x_pairs + k0 // 2, mask=(k0 + 2 * tl.arange(0, 16)) < K, other=0)
    if X_DTYPE.is_bf16():  # a bfloat16 is the top half of its float32
        low = (pairs << 16).to(tl.float32, bitcast=True)
        high = (pairs & -65536).to(tl.float32, bitcast=True)
    else:
        low = pairs.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _gemv_rows(
    x_rows,
    w_rows,
    sz_ptr,
    K,
    N,
    group_size,
    magic,
    shift16,
    first,
    last,
    offs_n,
    offs_p,
    n_mask,
    m_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_J: tl.constexpr,
    INT_ZEROS: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """As _gemv_one_row for BLOCK_M rows of x: float32 [BLOCK_M, BLOCK_N]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N, 32), dtype=tl.float32)
    for kb in tl.range(first, last, num_stages=NUM_STAGES):
        words = tl.load(w_rows + kb * 32, mask=n_mask[:, None], other=0)
        hi = words >> shift16  # a runtime 16: a constant lets LLVM fold the shift into each nibble's mask
        part = tl.zeros((BLOCK_M, BLOCK_N, 32), dtype=tl.float32)
        xsum = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
        for j in tl.static_range(8):
            k0 = kb * 256 + j * 32
            if j % GROUP_J == 0:
                group = _group_index(kb, j, group_size, GROUP_J)
                s, z = _load_scale_zero(sz_ptr, group, N, offs_n, n_mask)
            if EVEN_K:
                xj = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0).to(tl.float32)
            else:
                k_mask = (k0 + offs_p) < K
                xj = tl.load(x_rows + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                xj = xj.to(tl.float32)
            if INT_ZEROS:
                code = _unpack_nibble_minus(words, hi, j, magic, z[:, None])
            else:
                code = _unpack_nibble(words, hi, j, magic)
                xsum += xj
            part += code[None, :, :] * xj[:, None, :]
            if (j + 1) % GROUP_J == 0:
                if INT_ZEROS:
                    acc += s[None, :, None] * part
                else:
                    acc += s[None, :, None] * (part - z[None, :, None] * xsum[:, None, :])
                    xsum = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
                part = tl.zeros((BLOCK_M, BLOCK_N, 32), dtype=tl.float32)
    return tl.sum(acc, axis=2)


# The row count changes with the batch; BLOCK_M (a power of two >= M) carries what the code needs.
@host_launched
@triton.jit(do_not_specialize=["M"])
def _int4_gemv_kernel(
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
    GROUP_J: tl.constexpr,  # 32-code slices per group, at most 8 (a larger group is applied per block)
    INT_ZEROS: tl.constexpr,  # every zero point is an integer
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_BYTES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_PDL and PREFETCH_BYTES > 0:
        _prefetch_split_rows(qw_ptr, offs_n, N, K, stride_qn, pid_k * blocks_per_split, PREFETCH_BYTES)
    wait_for_previous_kernel(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, 32)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_p[None, :]
    num_blocks = tl.cdiv(K, 256)
    first = pid_k * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    if BLOCK_M == 1:  # batch 1: 2-D tiles only, x one row
        acc = _gemv_one_row(
            x_ptr,
            w_rows,
            sz_ptr,
            K,
            N,
            group_size,
            magic,
            shift16,
            first,
            last,
            offs_n,
            offs_p,
            n_mask,
            BLOCK_N,
            GROUP_J,
            INT_ZEROS,
            EVEN_K,
            NUM_STAGES,
        )[None, :]
    else:
        acc = _gemv_rows(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_p[None, :],
            w_rows,
            sz_ptr,
            K,
            N,
            group_size,
            magic,
            shift16,
            first,
            last,
            offs_n,
            offs_p,
            n_mask,
            m_mask,
            BLOCK_M,
            BLOCK_N,
            GROUP_J,
            INT_ZEROS,
            EVEN_K,
            NUM_STAGES,
        )
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
        counter_ptr + pid_n,
        pid_k,
        num_splits,
        HAS_BIAS,
        SPLIT,
    )
