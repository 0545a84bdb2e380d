"""The bitsandbytes 4-bit (nf4 / fp4) GEMM for a few rows (up to 8) on tensor cores with the weights never
leaving registers (Gluon, SM 8.0+): y = x @ W.T (+ bias) for kernels/nf4_pack.PackedNf4 as is (the codes as
bitsandbytes packs them, one absmax a block of `blocksize` codes). kernels/nf4_gemm.py launches it.

Why: the CUDA-core kernel (nf4_gemm's `_nf4_gemv_kernel`) widens every looked-up value to float32 and
multiplies it by its absmax before the multiply-add, and the tl.dot kernel pays a trip through shared
memory to put each dequantized tile into the MMA's operand layout. Here each code's value is picked with
byte permutes straight into a 16-bit register pair of the `mma.sync.m16n8k16` A fragment (the weight
rows are the MMA's 16 rows, x's rows its 8 columns), and the absmax is applied to the MMA's float32
results, once per 64 codes: the 64 codes a k-step group covers lie in one absmax block (blocksize >= 64).

How the layout lines up. In the A operand of m16n8k16, lane (g, t) (g = lane // 4, t = lane % 4) holds,
of rows g and g + 8, the columns 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-column step. The dot sums over k,
so which physical code sits at which logical column is free as long as x is read the same way. A block
of 256 codes is four groups of 64 (G); in group G the lane with t reads words 8G + 2t and 8G + 2t + 1 of
its row's block (W: one 8-byte load), and each 16-bit half h of a word, its bytes Jl and their nibbles
e (the high nibble is the even code) give logical column k = 32 W + 16 h + 8 Jl + 2 t + e of the group,
physical code 64 G + 16 t + 8 W + 4 h + 2 Jl + e. So a group's four k-steps (W, h) read codes 64 G ..
64 G + 63 only, one absmax a row; and x, read at the same physical codes, is 16 consecutive values a
lane and group (two 16-byte loads), each register pair already the B fragment's. The groups are the
batch dimension of one batched MMA per block, whose four partial tiles are scaled by their absmax and
summed in registers.

The lookup (LOOKUP_ASM): for 4 codes in 16 bits of a word, four PRMTs pick each value's low and high
bytes from entries 0-7 and 8-15 of the table (selector: the code & 7; the table is PackedNf4.mma_table,
nf4_pack.permute_table's words in the activation dtype), two more keep the half that bit 3 names, two
interleave them into the two registers of the fragment: 21 instructions for a word's 8 codes.

Precision: each code's value is rounded once to the activation dtype (bfloat16 keeps 8 bits of nf4's
values, float16 11), the products are summed in float32 by the MMA and multiplied by the float32 absmax;
the reference (nf4_pack.dequantize_packed) rounds value * absmax once instead. Split-K as the other
kernels (deterministic). Measured: benchmarks/gpu/nf4_gemm.py.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.mma_gemv_parts import _finish, _index, _wait_for_previous_kernel

BLOCK_CODES = 256  # codes of a row each loop step streams
GROUP_CODES = 64  # codes under one absmax in the kernel's view (the smallest blocksize it takes)
TILE_RANK = gl.constexpr(9)  # [G, row tile, n3, g, W, h, Jl, t, e]
WORD_RANK = gl.constexpr(6)  # [G, row tile, n3, g, W, t]
X_RANK = gl.constexpr(4)  # [G, t, pair, x row]


def _table(i: int) -> str:
    """Operand of table word i (pack 8: each argument is 8 operands, all the same register)."""
    return f"${12 + 8 * i}"


def _four_codes(selectors: str, halves: str, out: tuple[str, str]) -> str:
    """PTX: 4 codes' values from their selectors (code & 7 a nibble) and half pickers (per byte k: k, or
    k + 4 where the code's bit 3 is set) into two fragment registers: (high nibble's value, low nibble's)
    of byte 0, then of byte 1."""
    return f"""
    prmt.b32 la, {_table(0)}, {_table(1)}, {selectors};
    prmt.b32 lb, {_table(2)}, {_table(3)}, {selectors};
    prmt.b32 ha, {_table(4)}, {_table(5)}, {selectors};
    prmt.b32 hb, {_table(6)}, {_table(7)}, {selectors};
    prmt.b32 lo, la, lb, {halves};
    prmt.b32 hi, ha, hb, {halves};
    prmt.b32 {out[0]}, lo, hi, 0x4051;
    prmt.b32 {out[1]}, lo, hi, 0x6273;"""


# PTX: the 8 codes of a word ($4; pack 8: $4..$11 are the same word) -> $0..$3, the fragment's register
# pairs of bytes 0..3. The selectors of both halves are made at once (PRMT reads the low 16 bits of its
# selector). The 8 table words are arguments (read from memory once: ptxas rematerializes constants at
# every use).
LOOKUP_ASM = gl.constexpr(
    "{\n    .reg .b32 s, s2, u, u2, la, lb, ha, hb, lo, hi;"
    """
    and.b32 s, $4, 0x77777777;
    shr.b32 u, $4, 1;
    lop3.b32 u, u, 0x44444444, 0x32103210, 0xEA;
    shr.b32 s2, s, 16;
    shr.b32 u2, u, 16;"""
    + _four_codes("s", "u", ("$0", "$1"))
    + _four_codes("s2", "u2", ("$2", "$3"))
    + "\n}"
)
LOOKUP_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 72))


@gluon.constexpr_function
def tile_layout(num_warps):
    """The weight tile [4 (G), row tiles, 2, 8, 2 (W), 2 (h), 2 (Jl), 4 (t), 2 (e)] (row = 16 tile + 8 n3 +
    g): g and t on lanes as in the MMA, warps over 16-row tiles; among the registers e then Jl first (the
    4 codes one lookup turns into two fragment registers), then h and W (a word, and the 8-byte load of
    two), then G."""
    return gl.BlockedLayout(
        size_per_thread=[4, 1, 2, 1, 2, 2, 2, 1, 2],
        threads_per_warp=[1, 1, 1, 8, 1, 1, 1, 4, 1],
        warps_per_cta=[1, num_warps, 1, 1, 1, 1, 1, 1, 1],
        order=[8, 6, 5, 4, 0, 2, 1, 7, 3],
    )


@gluon.constexpr_function
def word_layout(num_warps):
    """The words [4 (G), row tiles, 2, 8, 2 (W), 4 (t)]: the tile layout without h, Jl and e."""
    return gl.SliceLayout(5, gl.SliceLayout(6, gl.SliceLayout(8, tile_layout(num_warps))))


@gluon.constexpr_function
def x_layout(num_warps):
    """x's tile as loaded, in int32 pairs: [4 (G), 4 (t), 8 (pairs 4 W + 2 h + Jl), BLOCK_M]: t and x's row
    on lanes as in the MMA's B operand, a lane's 16 consecutive codes in its registers (two 16-byte
    loads), every warp a copy. Pairs, not 16-bit values, cross the loop: carried as 16-bit scalars the
    pairs were rebuilt with a PRMT each."""
    return gl.BlockedLayout(
        size_per_thread=[4, 1, 8, 1],
        threads_per_warp=[1, 4, 1, 8],
        warps_per_cta=[num_warps, 1, 1, 1],
        order=[2, 0, 1, 3],
    )


@gluon.constexpr_function
def scale_layout(num_warps):
    """The absmax tile as loaded, [4 (G), row tiles, 2 (n3), 8 (g), 4 (t)]: rows as the MMA's (g on lanes,
    n3 in registers, warps over tiles), each lane's 4 groups of a row consecutive (one load of 4 float16),
    t a copy."""
    return gl.BlockedLayout(
        size_per_thread=[4, 1, 2, 1, 1],
        threads_per_warp=[1, 1, 1, 8, 4],
        warps_per_cta=[1, num_warps, 1, 1, 1],
        order=[0, 2, 1, 4, 3],
    )


@gluon.constexpr_function
def mma_layout(num_warps):
    """The batched MMA: the 4 groups of a block its batch, warps over the 16-row tiles."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps, 1], instr_shape=[1, 16, 8])


@fast_launch
@gluon.jit(do_not_specialize=["M"])
def _nf4_mma_gemv_kernel(
    x_ptr,
    w_ptr,  # the codes as int32 words [N, K / 8]
    s_ptr,  # absmax [N, K / BLOCKSIZE], float16 or float32
    bias_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    table_ptr,  # int32 [8]: nf4_pack.PackedNf4.mma_table
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_wn,  # K / 8 (words a row; an argument: 16-divisible where K is, so 8-byte loads)
    stride_sn,  # K / BLOCKSIZE (an argument, so that its divisibility lets the absmax loads widen)
    blocks_per_split,
    num_splits,
    HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,  # 8: x's rows, the MMA's columns
    ROW_TILES: gl.constexpr,  # 16-row tiles of W per warp (x's fragment is shared by them)
    BLOCKSIZE: gl.constexpr,  # codes per absmax: a power of two >= 64
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
    mma: gl.constexpr = mma_layout(num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    scales_layout: gl.constexpr = gl.SliceLayout(2, mma)

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    # the words: row n = BLOCK_N pid_n + 16 tile + 8 n3 + g, words 8 G + 2 t + W of each block (32 a row)
    rows = (
        pid_n * BLOCK_N
        + 16 * _index(TILES, 1, WORD_RANK, words_layout)
        + 8 * _index(2, 2, WORD_RANK, words_layout)
        + _index(8, 3, WORD_RANK, words_layout)
    )
    word_in_block = (
        8 * _index(4, 0, WORD_RANK, words_layout)
        + _index(2, 4, WORD_RANK, words_layout)
        + 2 * _index(4, 5, WORD_RANK, words_layout)
    )
    # rows past N and x's rows past M read the last real one (no masks); what they compute is not stored
    rows = gl.minimum(rows, N - 1)
    word_ptrs = w_ptr + rows.to(gl.int64) * stride_wn + word_in_block
    # the tile's shape (each word's 8 codes: the lookup's pack)
    codes = _index(2, 5, TILE_RANK, tiles) + _index(2, 6, TILE_RANK, tiles) + _index(2, 8, TILE_RANK, tiles)

    # the absmax of group G of each row: [4, row tiles, 2, 8, 1] (row = 16 tile + 8 n3 + g), as [4, BLOCK_N]
    # the batched MMA's row layout
    ss: gl.constexpr = scale_layout(num_warps)
    scale_rows = (
        pid_n * BLOCK_N
        + 16 * _index(TILES, 1, 5, ss)
        + 8 * _index(2, 2, 5, ss)
        + _index(8, 3, 5, ss)
        + 0 * _index(1, 4, 5, ss)
    )
    scale_ptrs = s_ptr + gl.minimum(scale_rows, N - 1).to(gl.int64) * stride_sn
    scale_groups = _index(4, 0, 5, ss)  # G (BLOCKSIZE 64: the absmax index within the block's four)

    # x: the pair of physical codes 64 G + 16 t + 2 (4 W + 2 h + Jl) (+ e) of the block, row m
    x_pairs = 32 * _index(4, 0, X_RANK, xs) + 8 * _index(4, 1, X_RANK, xs) + _index(8, 2, X_RANK, xs)
    x_rows = gl.minimum(_index(BLOCK_M, 3, X_RANK, xs), M - 1)
    x_words = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    x_ptrs = x_words + x_rows.to(gl.int64) * (stride_xm // 2) + x_pairs

    num_blocks = K // 256
    first = pid_k * blocks_per_split
    last = gl.minimum(first + blocks_per_split, num_blocks)
    # Each block's words and absmax are asked for while the block before it is computed (the last block
    # loads its own again rather than read past the split); the first block's before waiting for the
    # previous kernel (PDL: no kernel of the step writes them). x (a few KB every program reads, from the
    # L2) is read in its own step. Measured slower on the H100 (benchmarks/results/h100_nf4_mma_gemv.json,
    # "variants"): x one block ahead too (1-10%), the weights two blocks ahead (3-35%), a per-lane copy of
    # the table (no uniform-register copies, 80 registers: 15-50%); each lane reading 8 consecutive words
    # (16-byte loads, a different layout) gained 1-6%, not worth a layout of its own.
    words = gl.load(word_ptrs + first * 32)
    scales = _load_scales(scale_ptrs, first, scale_groups, BLOCKSIZE)
    _wait_for_previous_kernel(USE_PDL)
    tp = table_ptr
    t0, t1, t2, t3 = gl.load(tp), gl.load(tp + 1), gl.load(tp + 2), gl.load(tp + 3)
    t4, t5, t6, t7 = gl.load(tp + 4), gl.load(tp + 5), gl.load(tp + 6), gl.load(tp + 7)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, gl.SliceLayout(0, mma))
    for kb in range(first, last):
        following = gl.minimum(kb + 1, last - 1)
        next_words = gl.load(word_ptrs + following * 32)
        next_scales = _load_scales(scale_ptrs, following, scale_groups, BLOCKSIZE)
        xv = gl.load(x_ptrs + kb * 128)

        # pairs -> [G, t, W, h, Jl, m, e] -> [G, W, h, Jl, t, e, m], k = 32 W + 16 h + 8 Jl + 2 t + e (in
        # registers)
        x_even = (xv & 0xFFFF).to(gl.int16).to(dtype, bitcast=True)
        x_odd = (xv >> 16).to(gl.int16).to(dtype, bitcast=True)
        x_k = gl.reshape(gl.join(x_even, x_odd), [4, 4, 2, 2, 2, BLOCK_M, 2])
        x_k = gl.permute(x_k, [0, 2, 3, 4, 1, 6, 5])
        b = gl.convert_layout(gl.reshape(x_k, [4, 64, BLOCK_M]), b_layout)
        words_h = gl.expand_dims(gl.expand_dims(gl.expand_dims(words, 5), 6), 8)
        words_h, _ = gl.broadcast(words_h, codes)
        w = gl.inline_asm_elementwise(
            LOOKUP_ASM,
            LOOKUP_CONSTRAINTS,
            [words_h, t0, t1, t2, t3, t4, t5, t6, t7],
            dtype=x_ptr.dtype.element_ty,
            is_pure=True,
            pack=8,
        )
        a = gl.convert_layout(gl.reshape(w, [4, BLOCK_N, 64]), a_layout)
        groups = mma_v2(a, b, gl.zeros([4, BLOCK_N, BLOCK_M], gl.float32, mma))
        group_scales = gl.convert_layout(gl.reshape(scales.to(gl.float32), [4, BLOCK_N]), scales_layout)
        acc += gl.sum(groups * gl.expand_dims(group_scales, 2), axis=0)
        words, scales = next_words, next_scales

    _finish(acc, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, part_ptr, counter_ptr + pid_n, num_splits,
            BLOCK_N, BLOCK_M, HAS_BIAS, SPLIT, gl.SliceLayout(0, mma))  # fmt: skip


@gluon.jit
def _load_scales(scale_ptrs, kb, groups, BLOCKSIZE: gl.constexpr):
    """Block kb's absmax for its four groups of 64 codes (consecutive where BLOCKSIZE is 64: one load)."""
    if BLOCKSIZE == 64:
        return gl.load(scale_ptrs + kb * 4 + groups)
    return gl.load(scale_ptrs + (kb * 256 + groups * 64) // BLOCKSIZE)
