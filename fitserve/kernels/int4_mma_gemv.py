"""The int4 GEMM for a few rows (8, or 16) on tensor cores with the weights never leaving registers
(Gluon, SM 8.0+): y = x @ W.T (+ bias) for a W4A16 weight in kernels/int4_repack.py's layout, as is (no
second copy of the weight, no repack of its own). kernels/int4_gemm.py launches it for 1 to 8 rows.

Why: the CUDA-core kernel (kernels/int4_gemv_kernel.py) spends ~4.4 instructions on each weight (unpack,
zero point, multiply-add in float32) and its cost grows with every row of x; the tl.dot kernel
(kernels/int4_dot_kernel.py) pays a trip through shared memory to put each dequantized tile into the
MMA's operand layout. Here the dequantization is done on packed 16-bit pairs (Marlin's trick,
kernels/int4_pair_dequant.py), the multiply-add is an `mma.sync.m16n8k16` (the weight rows are the
MMA's 16 rows, x's rows its 8 or 16 columns), and the words are loaded straight into the threads that
own those weights in the operand layout. The loop is ~2.8 instructions a weight at 8 columns and groups
of 128 (sm_90 SASS; ~0.3 of them repack x's pairs, every warp for itself), the same at 1 and 8 rows:
tests/unit/test_int4_mma_gemv_sass.py. At 96 registers a thread, 5 programs of 4 warps fit an SM: at one
row the kernel is bound by latency with few warps to hide it (ncu, H200:
benchmarks/results/h200_int4_mma_gemv_loop.json), so what frees registers pays and what holds more does
not. Measured (H100, benchmarks/results/h100_int4_mma_gemv.json, with x then read a block ahead): 1.08x
the CUDA-core kernel at 1 row (Llama-3.1-8B's four layers, 56.8 against 61.4 us) and 1.25-1.28x the
tl.dot kernel at 2 to 8 rows.

How the layout lines up. In the A operand of m16n8k16 (16-bit), lane (g, t) (g = lane // 4, t = lane %
4) holds, of rows g and g + 8, the columns 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-column step. The dot
sums over k, so which physical code sits at which logical column is free as long as x is read the same
way. A program's 256 logical columns per block are split as k = 32 S + 8 J + 2 t + e (S, J, t, e of
8, 4, 4, 2); the lane with t and row n takes word 8 t + S of its row's block (8 consecutive words: two
16-byte loads) and J, e select the nibble J + 4 e, i.e. the physical code 32 (J + 4 e) + 8 t + S. One
shift and one LOP3 put nibbles J and J + 4 of a word under a 16-bit exponent as a pair (e = 0, 1), so
each pair is one packed-math dequantization (`int4_pair_dequant`'s PTX) feeding one 32-bit register of
the fragment. x is read at the same physical codes: for fixed t its 64 columns are runs of 8
consecutive values (16-byte loads). The 7-dimensional layouts below spell this out; reshaped to
[BLOCK_N, 256] they hold the same elements in each thread as the MMA operand layouts, so the
conversions between them move no data (only register names).

Zero points must be integers 0..16 (`PackedInt4.paired_zeros`: every int4 format's) so that BASE + z is
exact; each weight is (code - z) * scale rounded once to the activation dtype, bit for bit the
dequantized reference, and the products are summed in float32 by the MMA. Split-K as the other int4
kernels (the last program of a tile sums the splits' partials in split order: deterministic).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.int4_pair_dequant import PAIR_CONSTANTS, pair_ptx
from fitserve.kernels.mma_gemv_parts import _finish, _index, _wait_for_previous_kernel

# The pair dequantization (kernels/int4_pair_dequant.py's) with pack = 2: $1 / $2 the shifted word (the
# same for both halves), $3 the two scales, $4 the two -(BASE + z); out $0, the pair in one register.
_ASM_BY_DTYPE = {dtype: pair_ptx(dtype, "$1", "mov.b32 $0, t;") for dtype in PAIR_CONSTANTS}


@gluon.constexpr_function
def _base(dtype):
    """BASE: the value whose exponent the codes are OR-ed under (128 in bfloat16, 1024 in float16)."""
    return 128.0 if dtype == gl.bfloat16 else 1024.0


@gluon.constexpr_function
def _pair_asm(dtype):
    """The pair dequantization's PTX for activations of `dtype`."""
    return _ASM_BY_DTYPE["bf16" if dtype == gl.bfloat16 else "fp16"]


WORD_RANK = gl.constexpr(5)  # [row tile, n3, g, S, t]
TILE_RANK = gl.constexpr(7)  # [row tile, n3, g, S, J, t, e]


@gluon.constexpr_function
def tile_layout(num_warps):
    """The weight tile [row tiles, 2, 8, 8, 4, 4, 2] (row = 16 tile + 8 n3 + g; k = 32 S + 8 J + 2 t + e):
    g and t on lanes as in the MMA, warps over 16-row tiles; among the registers e first (the pair one
    32-bit register of the MMA fragment holds), then S (the words' 16-byte loads)."""
    return gl.BlockedLayout(
        size_per_thread=[1, 2, 1, 8, 4, 1, 2],
        threads_per_warp=[1, 1, 8, 1, 1, 4, 1],
        warps_per_cta=[num_warps, 1, 1, 1, 1, 1, 1],
        order=[6, 3, 4, 1, 0, 5, 2],
    )


@gluon.constexpr_function
def word_layout(num_warps):
    """The words [row tiles, 2, 8, 8, 4]: the tile layout without J and e."""
    return gl.SliceLayout(4, gl.SliceLayout(6, tile_layout(num_warps)))


@gluon.constexpr_function
def x_layout(num_warps):
    """x's tile [8 (S), 4 (J), 4 (t), 2 (e), BLOCK_M]: t and x's row on lanes as in the MMA's B operand,
    S first among the registers (16-byte loads), every warp a copy."""
    return gl.BlockedLayout(
        size_per_thread=[8, 4, 1, 2, 1],
        threads_per_warp=[1, 1, 4, 1, 8],
        warps_per_cta=[num_warps, 1, 1, 1, 1],
        order=[0, 3, 1, 2, 4],
    )


@fast_launch
@gluon.jit(do_not_specialize=["M"])
def _int4_mma_gemv_kernel(
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
    blocks_per_group,  # groups of 256 codes or more: blocks a group spans (per-channel: all of them)
    blocks_per_split,
    num_splits,
    HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,  # 8 or 16: x's rows, the MMA's columns
    ROW_TILES: gl.constexpr,  # 16-row tiles of W per warp (x's fragment is shared by them)
    GROUP_CODES: gl.constexpr,  # the group size if 32, 64 or 128, else 256 (a group spans whole blocks)
    EVEN_K: gl.constexpr,
    SPLIT: gl.constexpr,
    USE_PDL: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    TILES: gl.constexpr = num_warps * ROW_TILES
    BLOCK_N: gl.constexpr = 16 * TILES
    tiles: gl.constexpr = tile_layout(num_warps)
    words_layout: gl.constexpr = word_layout(num_warps)
    xs: gl.constexpr = x_layout(num_warps)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    # the words: row n = BLOCK_N pid_n + 16 tile + 8 n3 + g, word 8 t + S of each block
    rows = (
        pid_n * BLOCK_N
        + 16 * _index(TILES, 0, WORD_RANK, words_layout)
        + 8 * _index(2, 1, WORD_RANK, words_layout)
        + _index(8, 2, WORD_RANK, words_layout)
    )
    word_in_block = 8 * _index(4, 4, WORD_RANK, words_layout) + _index(8, 3, WORD_RANK, words_layout)
    # rows past N and x's rows past M read the last real one (no masks, so no zero-filled registers);
    # what they compute is never stored
    rows = gl.minimum(rows, N - 1)
    word_ptrs = qw_ptr + rows.to(gl.int64) * stride_qn + word_in_block

    # per element of the tile: the shift of its word that brings nibble J to bit 0 (and J + 4 to 16)
    shift = 4 * _index(4, 4, TILE_RANK, tiles) + 0 * _index(2, 6, TILE_RANK, tiles)
    # the (scale, zero point) words: rows as the weights, groups along J (groups of 32, 64 codes) and e
    # (up to 128) where a block has several
    GROUP_J: gl.constexpr = 4 if GROUP_CODES < 128 else 1
    GROUP_E: gl.constexpr = 2 if GROUP_CODES < 256 else 1
    sz_rows = gl.expand_dims(gl.expand_dims(rows, 4), 6)  # the words' rows, in the tile's layout
    sz_codes = 32 * _index(GROUP_J, 4, TILE_RANK, tiles) + 128 * _index(GROUP_E, 6, TILE_RANK, tiles)
    sz_words = sz_ptr.to(gl.pointer_type(gl.int32), bitcast=True)

    # x: physical code 32 (J + 4 e) + 8 t + S of the block, row m
    x_codes = (
        _index(8, 0, WORD_RANK, xs)
        + 32 * _index(4, 1, WORD_RANK, xs)
        + 8 * _index(4, 2, WORD_RANK, xs)
        + 128 * _index(2, 3, WORD_RANK, xs)
    )
    x_rows = gl.minimum(_index(BLOCK_M, 4, WORD_RANK, xs), M - 1)
    x_ptrs = x_ptr + x_rows.to(gl.int64) * stride_xm + x_codes

    num_blocks = gl.cdiv(K, 256)
    first = pid_k * blocks_per_split
    last = gl.minimum(first + blocks_per_split, num_blocks)
    sz_ptrs = sz_words + sz_rows
    # Each block's words and scales are asked for while the block before it is computed (the last block
    # loads its own again rather than read past the split); the first block's before waiting for the
    # previous kernel (PDL: no kernel of the step writes them). x's tile (a few KB every program reads,
    # from the L2) is read in its own block's step, its latency covered by the dequantization: holding it
    # a block ahead too took 124 registers a thread against 96 (4 programs an SM against 5) and measured
    # slower on an H200 (Llama-3.1-8B batch 1 443.8 against 465.0 tok/s, batch 4 2.314 against 2.241 ms a
    # step: benchmarks/results/h200_int4_mma_gemv_loop.json). A cp.async ring of 2 to 6 blocks in shared
    # memory and an L2 prefetch of the rows before the wait measured slower still (same file), as did the
    # weights two blocks ahead on an H100 (138 registers, one program less on each SM).
    words, sz = _load_weights(word_ptrs, sz_ptrs, first, blocks_per_group, sz_codes, N, GROUP_CODES)
    _wait_for_previous_kernel(USE_PDL)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    for kb in range(first, last):
        following = gl.minimum(kb + 1, last - 1)
        xv = _load_x(x_ptrs, kb, x_codes, K, EVEN_K)
        next_words, next_sz = _load_weights(word_ptrs, sz_ptrs, following, blocks_per_group, sz_codes, N,
                                            GROUP_CODES)  # fmt: skip

        b = gl.convert_layout(gl.reshape(xv, [256, BLOCK_M]), b_layout)
        scale = (sz & 0xFFFF).to(gl.int16).to(dtype, bitcast=True)
        zero = (sz >> 16).to(gl.int16).to(dtype, bitcast=True).to(gl.float32)
        neg_base = (-(_base(dtype) + zero)).to(dtype)
        shifted = gl.expand_dims(gl.expand_dims(words, 4), 6) >> shift
        scale, shifted = gl.broadcast(scale, shifted)
        neg_base, shifted = gl.broadcast(neg_base, shifted)
        w = gl.inline_asm_elementwise(
            _pair_asm(dtype),
            "=r,r,r,r,r",
            [shifted, scale, neg_base],
            dtype=x_ptr.dtype.element_ty,
            is_pure=True,
            pack=2,
        )
        a = gl.convert_layout(gl.reshape(w, [BLOCK_N, 256]), a_layout)
        acc = mma_v2(a, b, acc)
        words, sz = next_words, next_sz

    _finish(acc, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, part_ptr, counter_ptr + pid_n, num_splits,
            BLOCK_N, BLOCK_M, HAS_BIAS, SPLIT, mma)  # fmt: skip


@gluon.jit
def _load_weights(word_ptrs, sz_ptrs, kb, blocks_per_group, sz_codes, N, GROUP_CODES: gl.constexpr):
    """Block kb's words and its (scale, zero point) words."""
    words = gl.load(word_ptrs + kb * 32)
    if GROUP_CODES < 256:
        group = kb * (256 // GROUP_CODES) + sz_codes // GROUP_CODES
    else:  # groups of whole blocks
        group = kb // blocks_per_group + 0 * sz_codes
    return words, gl.load(sz_ptrs + group * N)


@gluon.jit
def _load_x(x_ptrs, kb, x_codes, K, EVEN_K: gl.constexpr):
    """Block kb's tile of x."""
    if EVEN_K:
        return gl.load(x_ptrs + kb * 256)
    # codes past K are 0, but (0 - z) * s is not: x must be 0 there
    return gl.load(x_ptrs + kb * 256, mask=kb * 256 + x_codes < K, other=0.0)
