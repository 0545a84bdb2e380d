"""The @triton.jit pieces both int4 GEMM kernels share (kernels/int4_gemv_kernel.py, CUDA cores, and
kernels/int4_dot_kernel.py, tensor cores; their host side, kernels/int4_gemm.py, says which runs when).

- Codes to float32 (`_nibble_bits`, `_unpack_nibble`, `_unpack_nibble_minus`): nibble j of every int32
  word (layout of kernels/int4_repack.py) becomes exact float32 with one AND+OR (a LOP3: the code's bits
  under the exponent of 2**23; int4_gemm.MAGIC is a kernel argument so that ptxas fuses the two) and one
  FMA that subtracts 2**23 (and an integer zero point with it) and undoes the nibble's 16**(j % 4)
  position (words >> 16 once gives nibbles 4..7).
- A group's (scale, zero point) pairs for BLOCK_N weight rows (`_group_index`, `_load_scale_zero`).
- The L2 prefetch of a program's weight rows before it waits for the previous kernel
  (`_prefetch_split_rows`, kernels/l2_prefetch.py).
- The end of every program (`_finish`, which kernels/nf4_gemm.py uses too): split-K without a second
  kernel and deterministic. Each split stores its float32 partial tile in a workspace [splits, M, N],
  then (after a CTA barrier) one thread bumps the tile's counter in `PackedInt4.counters` with an
  acq_rel atomic. The program that arrives last sums the partials in split order (the same order
  whoever arrives last, so the result is bitwise reproducible), adds the bias, writes y and resets the
  counter to 0 for the next call.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fitserve.kernels.l2_prefetch import prefetch_to_l2


@triton.jit
def _nibble_bits(words, hi, J: tl.constexpr, magic):
    """Nibble J (0..7) of every int32 word q, as the float32 2**23 + q * 16**(J % 4): one AND+OR (LOP3)
    puts the code's bits under float32's exponent of 2**23 (words >> 16 once gives nibbles 4..7).
    `magic` is MAGIC passed as a kernel argument: with two immediates ptxas emits two LOP3s."""
    SHIFT: tl.constexpr = 4 * (J % 4)
    source = words if J < 4 else hi
    return ((source & (0xF << SHIFT)) | magic).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_nibble(words, hi, J: tl.constexpr, magic):
    """Nibble J (0..7) of every int32 word as exact float32 0.0 .. 15.0 (one LOP3 and one FMA)."""
    SCALE: tl.constexpr = 1.0 / (1 << (4 * (J % 4)))
    return tl.fma(_nibble_bits(words, hi, J, magic), SCALE, -8388608.0 * SCALE)


@triton.jit
def _unpack_nibble_minus(words, hi, J: tl.constexpr, magic, zero):
    """Nibble J as exact float32 code - zero, for integer zero points (2**23 / 16**(J % 4) + zero is then
    exact): the subtraction rides on the unpacking FMA."""
    SCALE: tl.constexpr = 1.0 / (1 << (4 * (J % 4)))
    return tl.fma(_nibble_bits(words, hi, J, magic), SCALE, (-8388608.0 * SCALE) - zero)


@triton.jit
def _prefetch_split_rows(qw_ptr, offs_n, N, K, stride_qn, first, BYTES: tl.constexpr):
    """Asks the L2 for the first BYTES (at most the rest of the row) of this program's range of each of
    its weight rows (kernels/l2_prefetch.py: before waiting for the previous kernel; weights are never
    written, so this is safe)."""
    size = tl.minimum(BYTES, (tl.cdiv(K, 256) - first) * 128)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    addresses = (qw_ptr + rows * stride_qn + first * 32).to(tl.int64)
    prefetch_to_l2(addresses, tl.zeros_like(offs_n) + size)


@triton.jit
def _group_index(kb, J: tl.constexpr, group_size, GROUP_J: tl.constexpr):
    """The group of slice J of block kb: no division for groups of up to 128 codes."""
    if GROUP_J < 8:
        return kb * (8 // GROUP_J) + J // GROUP_J
    else:
        return (kb * 256) // group_size


@triton.jit
def _load_scale_zero(sz_ptr, group, N, offs_n, n_mask):
    """The (scale, zero point) pairs of one group for BLOCK_N weight rows, as float32 [BLOCK_N] each: one
    4-byte load per row (which the pipeliner can copy asynchronously; 2-byte loads it cannot)."""
    pairs = sz_ptr + (group * N + offs_n)[:, None] * 2 + tl.arange(0, 2)[None, :]
    scale, zero = tl.split(tl.load(pairs, mask=n_mask[:, None], other=0.0))
    return scale.to(tl.float32), zero.to(tl.float32)


@triton.jit
def _write_out(acc, offs_m, offs_n, M, N, y_ptr, stride_ym, bias_ptr, HAS_BIAS: tl.constexpr):
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit
def _finish(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    y_ptr,
    stride_ym,
    bias_ptr,
    part_ptr,
    counter_ptr,
    pid_k,
    num_splits,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Writes acc [BLOCK_M, BLOCK_N] (float32) to y, or with split-K: stores it as this split's partial
    and, in the program that arrives last at this tile's counter, sums all partials in split order."""
    if SPLIT:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        part = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            total = tl.zeros_like(acc)
            for split in range(0, num_splits):
                total += tl.load(part + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _write_out(total, offs_m, offs_n, M, N, y_ptr, stride_ym, bias_ptr, HAS_BIAS)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        _write_out(acc, offs_m, offs_n, M, N, y_ptr, stride_ym, bias_ptr, HAS_BIAS)
