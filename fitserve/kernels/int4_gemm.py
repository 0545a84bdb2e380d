"""y = x @ W.T (+ bias) for a weight W stored as 4-bit codes (W4A16): one kernel family for every int4
format (AWQ, GPTQ, compressed-tensors, AutoRound), which the loader repacks once into the layout of
kernels/int4_repack.py (`repack_int4`: int32 words of 8 codes, 256 codes = 128 bytes per weight row per
block, nibble j of the block's 32 words = its 32 consecutive codes 32 j .. 32 j + 31; per group and
weight row a (scale, zero point) pair in the activation dtype).

Two kernels, picked by the number of rows M of x (`choose_config`, a deterministic rule of M, N, K and
the GPU's SM count: no autotuning at run time, since fitserve captures CUDA graphs):

- `_int4_gemv_kernel`, M <= GEMV_MAX_ROWS (batch-1 decode): CUDA cores, no tensor cores. A program owns
  BLOCK_N weight rows and a range of 256-code blocks of K (split-K, so that small layers still give
  every SM several programs). Per block it loads a [BLOCK_N, 32] tile of words (one 128-byte line per
  row; Triton's pipeliner copies it, and the group's scale / zero pairs, NUM_STAGES blocks ahead) and,
  for each nibble j, turns the codes into exact float32 with one AND+OR (a LOP3: the code's bits under
  the exponent of 2**23; MAGIC is a kernel argument so that ptxas fuses the two) and one FMA that
  subtracts 2**23 and the zero point and undoes the nibble's 16**(j % 4) position (words >> 16 once
  gives nibbles 4..7; the 16 is a runtime argument too, else LLVM folds the shift into every nibble),
  then one FMA with x into a float32 [BLOCK_N, 32] partial. At the end of a group the partial is
  scaled into the accumulator (acc += s * partial, elementwise: no shuffles in the loop); the columns
  are summed once, after it. x is read as int32 pairs against the tile's even and odd columns, so a
  value is widened with one instruction. In the sm_90 SASS (compiled here, no GPU) the loop costs
  ~4.4 instructions per weight at BLOCK_N 64 on 2 warps (3 of them the LOP3 and the two FMAs): an
  H100 streaming 3.35 TB/s of 4-bit weights must retire 25.6 weights per SM per clock (1.98 GHz) of
  its 128 instruction slots, so the kernel is near the issue limit and the H100 sweep decides how
  close to the bandwidth it gets. Zero points that are not integers (PackedInt4.integer_zeros False)
  take the slower form acc += s * (partial - z * sum x).
- `_int4_dot_kernel`, more rows: a [BLOCK_M, BLOCK_N] output tile, K in 256-code blocks; each nibble j
  is dequantized in registers (w = q * s - z * s, rounded to x's dtype) and fed to tl.dot with depth 32
  against the matching 32 columns of x, float32 accumulation. SWAP_AB computes the transposed tile
  (acc[BLOCK_N, BLOCK_M] = W x.T, the weight on the MMA's long side, as kernels/swapped_gemm.py does);
  choose_config uses it for 17 to 64 rows (2 to 16: BLOCK_M 16 unswapped, on mma.sync), with split-K
  up to 64 rows. ~6 instructions per weight in
  the loop (SASS) whatever the rows: from 2 rows on it beats the CUDA-core loop (~7.5 at 2 rows).
  Triton waits for each warpgroup MMA before the next slice's dequantized weights may take its shared
  memory, so 8 dots of depth 32 a block serialise dequantization and MMA 8 times. WIDE_K (choose_config:
  past 64 rows) joins the block's 8 slices and reorders them into its [BLOCK_N, 256] weights in natural
  K order (k = 32 j + i) for one dot of depth 256 against x's contiguous [BLOCK_M, 256]: one wait a
  block, at about the same instruction count.

Split-K without a second kernel and deterministic: each split stores its float32 partial tile in a
workspace [splits, M, N], then (after a CTA barrier) one thread bumps the tile's counter in
`PackedInt4.counters` with an acq_rel atomic. The program that arrives last sums the partials in split
order (the same order whoever arrives last, so the result is bitwise reproducible), adds the bias,
writes y and resets the counter to 0 for the next call. Nothing is synchronised with the host and
the only allocations are torch.empty of y and of the workspace, so calls can be captured in CUDA graphs
(one layer's calls must not run concurrently on two streams: they share its counters).
Both kernels launch with programmatic dependent launch on SM 9.0+ (kernels/dependent_launch.py).

What the lead should sweep on the H100 (benchmarks/gpu/int4_gemm.py --sweep times these per shape):
- GEMV (1 row; 2 to 4 rows against the dot kernel): BLOCK_N 16 / 32 / 64 / 128, num_warps 1 / 2 / 4 /
  8, num_stages 2 / 3 / 4, split_k (auto from GEMV_PROGRAMS_PER_SM, MIN_BLOCKS_PER_SPLIT), and
  GEMV_MAX_ROWS.
- dot, 2 to 64 rows: BLOCK_N 64 / 128, SWAP_AB and WIDE_K on / off, num_warps 4 / 8, num_stages 2 to
  5, split_k (DOT_PROGRAMS_PER_SM).
- dot, more rows: BLOCK_M 64 / 128, BLOCK_N 64 / 128 / 256, num_warps 4 / 8, num_stages 2 / 3 (x's
  [BLOCK_M, 256] tile is BLOCK_M / 2 KB a stage: 128 x 128 with 3 stages needs 232 KB, more than the
  227 KB a program may have, and raises OutOfResources), WIDE_K, SWAP_AB, GROUP_M (the L2 swizzle of
  tiles).

Reference: `int4_repack.dequantize_reference`, then x.float() @ W.T. Imports triton: CUDA code paths
only (kernels/__init__.py). Under TRITON_INTERPRET=1 it also runs on CPU tensors (slowly), which
tests/unit/test_int4_gemm_interpret.py uses.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import SHARED_MEMORY_PER_BLOCK, kernel_capability, shared_memory_per_block
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv, next_power_of_2
from fitserve.kernels.int4_repack import BLOCK_K, MAX_SPLIT_ROW_TILES, MIN_BLOCK_N, PackedInt4
from fitserve.kernels.l2_prefetch import prefetch_to_l2

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# fast_launch wraps compiled kernels; the interpreter runs the Python function itself.
_host_launched = (lambda function: function) if INTERPRETING else fast_launch

# Rows of x the CUDA-core kernel takes by default. Per 4-bit weight its loop is ~4.5 instructions at one
# row (SASS of the sm_90 build), ~7.5 at two and ~10.6 at four, against ~6 for the tensor-core kernel
# at any row count up to 64: past one row the tensor cores win.
GEMV_MAX_ROWS = 1
SPLIT_MAX_ROWS = 64  # split-K only up to this many rows (past it the tiles fill the GPU)
GEMV_PROGRAMS_PER_SM = 4  # split K until there are this many programs per SM (or splits get short)
DOT_PROGRAMS_PER_SM = 2
MIN_BLOCKS_PER_SPLIT = 2  # a split streams at least 2 x 256 codes per weight row
MAX_SPLITS = 16
# Bytes of each of its weight rows (1,024 codes, the weights of skinny_gemm's 2 KB of bf16) a program
# of a streaming call asks the L2 for before waiting for the previous kernel (0: off).
PREFETCH_ROW_BYTES = 512
# float32 bits of 2**23: OR-ed over a code held in the low mantissa bits gives 2**23 + code, exactly.
MAGIC = 0x4B000000
DEFAULT_SM_COUNT = 132  # an H100 SXM; used only where no CUDA device is at hand (the interpreter)


@dataclass(frozen=True)
class Int4GemmConfig:
    """One launch configuration. split_k None: chosen from the grid and the SM count (choose_config)."""

    kernel: str  # "gemv" or "dot"
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None
    swap_ab: bool = False  # dot only
    wide_k: bool = False  # dot only: one tl.dot of depth 256 per block instead of 8 of depth 32
    group_m: int = 8  # dot only: row tiles per L2 swizzle group


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
def _dequantize_slice(
    words, hi, kb, J: tl.constexpr, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype
):
    """Slice J of block kb (32 codes a row) as weights in x's dtype: [BLOCK_N, 32]."""
    s, z = _load_scale_zero(sz_ptr, _group_index(kb, J, group_size, GROUP_J), N, offs_n, n_mask)
    return tl.fma(_unpack_nibble(words, hi, J, magic), s[:, None], (-z * s)[:, None]).to(dtype)


@triton.jit
def _wide_block_dot(
    acc,
    words,
    hi,
    kb,
    x_ptr,
    offs_m,
    m_mask,
    stride_xm,
    sz_ptr,
    group_size,
    N,
    K,
    offs_n,
    n_mask,
    magic,
    GROUP_J: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    """acc += one whole block as a single tl.dot of depth 256 (instead of 8 of depth 32, each of which
    Triton waits for): the 8 slices are joined and reordered into the block's [BLOCK_N, 256] weights."""
    dtype = x_ptr.dtype.element_ty
    w0 = _dequantize_slice(words, hi, kb, 0, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w1 = _dequantize_slice(words, hi, kb, 1, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w2 = _dequantize_slice(words, hi, kb, 2, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w3 = _dequantize_slice(words, hi, kb, 3, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w4 = _dequantize_slice(words, hi, kb, 4, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w5 = _dequantize_slice(words, hi, kb, 5, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w6 = _dequantize_slice(words, hi, kb, 6, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
    w7 = _dequantize_slice(words, hi, kb, 7, magic, sz_ptr, group_size, N, offs_n, n_mask, GROUP_J, dtype)
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
@_host_launched
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


@_host_launched
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
        hi = words >> shift16  # a runtime 16: a constant lets LLVM fold the shift into each nibble's mask
        if WIDE_K:
            acc = _wide_block_dot(
                acc,
                words,
                hi,
                kb,
                x_ptr,
                offs_m,
                m_mask,
                stride_xm,
                sz_ptr,
                group_size,
                N,
                K,
                offs_n,
                n_mask,
                magic,
                GROUP_J,
                EVEN_K,
                SWAP_AB,
            )
        else:
            for j in tl.static_range(8):
                k0 = kb * 256 + j * 32
                if j % GROUP_J == 0:  # a group (or for larger groups, the block) starts
                    s, z = _load_scale_zero(
                        sz_ptr, _group_index(kb, j, group_size, GROUP_J), N, offs_n, n_mask
                    )
                    b = -z * s
                w = tl.fma(_unpack_nibble(words, hi, j, magic), s[:, None], b[:, None]).to(dtype)
                if EVEN_K:
                    xj = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)
                else:
                    xj = tl.load(x_rows + k0, mask=m_mask[:, None] & ((k0 + offs_p) < K)[None, :], other=0.0)
                acc = tl.dot(w, tl.trans(xj), acc) if SWAP_AB else tl.dot(xj, tl.trans(w), acc)
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


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (DEFAULT_SM_COUNT off CUDA, for the interpreter)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_shared_bytes(config: Int4GemmConfig) -> int:
    """About the shared memory a dot config asks for (sm_80+, where stages are cp.async buffers):
    num_stages - 1 buffers of x's [BLOCK_M, 256] tile (16-bit) and the words' [BLOCK_N, 32] (int32),
    WIDE_K's [BLOCK_N, 256] weight tile, 4 KB besides (sm_86 build: 64 x 64, 4 stages, 124 KB)."""
    stage = config.block_m * BLOCK_K * 2 + config.block_n * 32 * 4
    wide = config.block_n * BLOCK_K * 2 if config.wide_k else 0
    return (config.num_stages - 1) * stage + wide + 4096


def fit_shared_memory(config: Int4GemmConfig, shared_memory: int) -> Int4GemmConfig:
    """`config` with fewer stages (down to 2), then a smaller tile, then without WIDE_K's weight tile,
    until dot_shared_bytes fits a block's `shared_memory` (kernels/capability.py): the H100's configs as
    chosen, smaller GPUs' cut down (tests/unit/test_kernel_targets.py compiles them for each)."""
    if config.kernel != "dot":
        return config
    while dot_shared_bytes(config) > shared_memory:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_m > 64 and not config.swap_ab:
            config = replace(config, block_m=config.block_m // 2, num_warps=4)
        elif config.block_n > 64:
            config = replace(config, block_n=config.block_n // 2)
        elif config.wide_k:
            config = replace(config, wide_k=False)
        else:
            break
    return config


def choose_config(
    rows: int,
    out_features: int,
    in_features: int,
    sms: int = DEFAULT_SM_COUNT,
    shared_memory: int = SHARED_MEMORY_PER_BLOCK[(9, 0)],
) -> Int4GemmConfig:
    """The launch configuration for x [rows, K] @ W[N, K].T: a fixed rule (no autotuning), split-K
    resolved. First guesses, to be swept on an H100 (module docstring); on GPUs whose blocks may have
    less shared memory than `shared_memory` (the H100's), cut down by fit_shared_memory."""
    if rows <= GEMV_MAX_ROWS:
        # 64 weight rows over 2 warps: 8 rows a thread, over which each x value's widening is shared
        # (3 stages: ~240 registers a thread; 2 stages: 168, 6 programs an SM, 96 KB of loads in flight)
        config = Int4GemmConfig("gemv", block_m=next_power_of_2(rows), block_n=64, num_warps=2, num_stages=2)
    elif rows <= 16:
        config = Int4GemmConfig("dot", block_m=16, block_n=64, num_warps=4, num_stages=4)
    elif rows <= SPLIT_MAX_ROWS:
        block_m = next_power_of_2(rows)
        config = Int4GemmConfig("dot", block_m=block_m, block_n=64, num_warps=4, num_stages=4, swap_ab=True)
    elif rows <= 256:  # shared memory per stage: x [BLOCK_M, 256] and words [BLOCK_N, 32] (227 KB at most)
        config = Int4GemmConfig("dot", block_m=64, block_n=128, num_warps=4, num_stages=3, wide_k=True)
    else:
        config = Int4GemmConfig("dot", block_m=128, block_n=128, num_warps=8, num_stages=2, wide_k=True)
    config = fit_shared_memory(config, shared_memory)
    return resolve_split(config, rows, out_features, in_features, sms)


def resolve_split(
    config: Int4GemmConfig, rows: int, out_features: int, in_features: int, sms: int
) -> Int4GemmConfig:
    """config with split_k set: as given (at most one split per 256-code block), else from the grid."""
    blocks = cdiv(in_features, BLOCK_K)
    tiles = cdiv(rows, config.block_m) * cdiv(out_features, config.block_n)
    if config.split_k is not None:
        splits = max(1, min(config.split_k, blocks))
    elif rows > SPLIT_MAX_ROWS or tiles > _counter_slots(out_features):
        splits = 1
    else:
        per_sm = GEMV_PROGRAMS_PER_SM if config.kernel == "gemv" else DOT_PROGRAMS_PER_SM
        splits = cdiv(per_sm * sms, tiles)
        splits = max(1, min(splits, MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))
    splits = cdiv(blocks, cdiv(blocks, splits))  # no empty split
    return replace(config, split_k=splits)


def _counter_slots(out_features: int) -> int:
    return cdiv(out_features, MIN_BLOCK_N) * MAX_SPLIT_ROW_TILES


def supports(x: torch.Tensor, packed: PackedInt4) -> bool:
    """True when int4_linear takes x for this weight (CUDA, or CPU under the interpreter)."""
    return (
        (x.is_cuda or INTERPRETING)
        and x.dim() == 2
        and x.shape[1] == packed.in_features
        and x.dtype == packed.dtype
        and x.device == packed.device
        and x.stride(1) == 1
        and x.data_ptr() % 4 == 0  # the batch-1 kernel reads x as int32 pairs
    )


def int4_linear(
    x: torch.Tensor,
    packed: PackedInt4,
    bias: torch.Tensor | None = None,
    config: Int4GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bfloat16 / float16) @ W.T (+ bias [N]) -> y [M, N] in x's dtype, W from `packed`."""
    if not supports(x, packed):
        raise ValueError(
            f"int4_linear takes CUDA x [M, {packed.in_features}] in {packed.dtype} with contiguous rows on "
            f"{packed.device}; got x {tuple(x.shape)} {x.dtype} on {x.device} (stride {x.stride()})"
        )
    rows, in_features = x.shape
    out_features = packed.out_features
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    sms = sm_count(x.device)
    if config is None:
        shared_memory = shared_memory_per_block(kernel_capability(x.device))
        config = choose_config(rows, out_features, in_features, sms, shared_memory)
    else:
        check_config(config, rows)
        config = resolve_split(config, rows, out_features, in_features, sms)
    splits = config.split_k
    blocks = cdiv(in_features, BLOCK_K)
    blocks_per_split = cdiv(blocks, splits)
    tiles_n = cdiv(out_features, config.block_n)
    tiles = cdiv(rows, config.block_m) * tiles_n if config.kernel == "dot" else tiles_n
    if splits > 1:
        if tiles > packed.counters.numel():
            raise ValueError(
                f"split-K over {tiles} output tiles needs more than the layer's {packed.counters.numel()} "
                f"counters: use larger tiles or split_k=1 for {rows} rows"
            )
        workspace = torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device)
    else:
        workspace = y  # not read
    group_size = packed.group_size
    group_j = min(group_size, BLOCK_K) // 32  # groups > 256 codes: multiples of 256, or K (per-channel)
    args = (
        x,
        packed.qweight,
        packed.scale_zero,
        bias if bias is not None else packed.scale_zero,
        y,
        workspace,
        packed.counters,
        rows,
        out_features,
        in_features,
        x.stride(0),
        packed.qweight.stride(0),
        y.stride(0),
        group_size,
        blocks_per_split,
        splits,
        MAGIC,
        16,
    )
    common = {
        "HAS_BIAS": bias is not None,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "GROUP_J": group_j,
        "EVEN_K": in_features % BLOCK_K == 0,
        "SPLIT": splits > 1,
        # streaming calls ask the L2 for the head of their weight rows before waiting (PDL only)
        "PREFETCH_BYTES": PREFETCH_ROW_BYTES if rows <= SPLIT_MAX_ROWS else 0,
    }
    if config.kernel == "gemv":
        common["INT_ZEROS"] = packed.integer_zeros
        _launch(_int4_gemv_kernel, (tiles_n, splits), args, common, config, x.device)
    else:
        common.update(SWAP_AB=config.swap_ab, GROUP_M=config.group_m, WIDE_K=config.wide_k)
        _launch(_int4_dot_kernel, (tiles, splits), args, common, config, x.device)
    return y


def check_config(config: Int4GemmConfig, rows: int) -> None:
    """Raises ValueError for a configuration the kernels cannot run for `rows` rows of x."""
    sizes = (config.block_m, config.block_n, config.num_warps)
    problem = None
    if config.kernel not in ("gemv", "dot"):
        problem = "kernel must be 'gemv' or 'dot'"
    elif any(size < 1 or size & (size - 1) for size in sizes):
        problem = "block_m, block_n and num_warps must be powers of two"
    elif config.kernel == "gemv" and config.block_m < rows:
        problem = f"the gemv kernel takes at most block_m rows, here {rows}"
    elif config.kernel == "dot" and min(config.block_m, config.block_n) < 16:
        problem = "tl.dot needs block_m and block_n >= 16"
    if problem:
        raise ValueError(f"int4 GEMM config {config}: {problem}")


def _launch(kernel, grid, args, constexprs, config: Int4GemmConfig, device: torch.device) -> None:
    options = {"NUM_STAGES": config.num_stages, "num_warps": config.num_warps}
    if INTERPRETING:  # the interpreter runs the JIT function itself, without launch options
        kernel[grid](*args, **constexprs, NUM_STAGES=config.num_stages, USE_PDL=False)
        return
    kernel[grid](*args, **constexprs, **options, **pdl_kwargs(device))
