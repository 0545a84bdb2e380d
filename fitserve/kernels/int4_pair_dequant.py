"""Two 4-bit codes to two 16-bit weights per instruction pair: the dequantization of the int4 tensor-core
kernel (kernels/int4_dot_kernel.py `_int4_dot_kernel`, PAIRED) on GPUs.

The float32 route (kernels/int4_kernel_parts.py `_unpack_nibble`: a LOP3 puts a code under float32's
exponent of 2**23, an FMA takes 2**23 and the zero point away and applies the scale, then a conversion to
16 bits) costs ~6 instructions per weight, which keeps the kernel busy issuing instructions while HBM
idles. This module does the same arithmetic on packed 16-bit pairs (bf16x2 / f16x2 registers, Marlin's idea):

    t = (word >> 4 p) & 0x000F000F | BASE_BITS      one LOP3 (the shift is shared by both halves)
    d = t * 1 + (-(BASE + z))                        one FMA on the pair: the codes minus the zero point
    w = d * s + (-0)                                 one FMA on the pair: times the scale, rounded once

BASE is 128 for bfloat16 (0x4300) and 1024 for float16 (0x6400): OR-ing a code 0..15 under that
exponent gives BASE + code exactly. With the layout of kernels/int4_repack.py (nibble j of word i of a
block = code 32 j + i), the low half of t is nibble p (the block's code 32 p + i) and the high half is
nibble p + 4 (code 32 (p + 4) + i): one call gives two [BLOCK_N, 32] slices of the block, whose
(scale, zero point) pairs come packed the same way (low half for slice p, high half for slice p + 4).

Exactness: t - (BASE + z) is an integer below 256 in magnitude (exact in both dtypes) when the zero
point is an integer with BASE + z exact, which `PackedInt4.paired_zeros` checks at repack (zero points
0 .. int4_repack.MAX_PAIRED_ZERO = 16: all int4 formats); the product with the scale is rounded once,
so every weight equals the reference's (code - z) * s rounded to the activation dtype
(kernels/int4_repack.py `dequantize_packed`, then `.to(dtype)`), bit for bit.

Cost: ~1.5 instructions per weight (a shift and a LOP3 per two weights, two packed FMAs per two). PTX
`fma.rn.bf16x2` needs sm_80, `fma.rn.f16x2` sm_53: bfloat16 activations only run where the GPU has
bfloat16 (auto-fit picks float16 below 8.0). Inline PTX does not run under TRITON_INTERPRET: the
interpreter takes the float32 route (`int4_gemm.paired_dequant_ok`).
"""

from __future__ import annotations

import triton
import triton.language as tl

# (BASE, BASE) and (1.0, 1.0) as bfloat16 pairs (128 = 0x4300) and as float16 pairs (1024 = 0x6400), and
# the packed FMA of each
PAIR_CONSTANTS = {
    "bf16": ("0x43004300", "0x3F803F80", "fma.rn.bf16x2"),
    "fp16": ("0x64006400", "0x3C003C00", "fma.rn.f16x2"),
}


def pair_ptx(dtype: str, word: str, store: str) -> str:
    """The PTX of one pair for activations of `dtype` ("bf16" or "fp16"): `word` the shifted word's
    operand, $3 the scale pair, $4 the -(BASE + z) pair; `store` moves t, the weight pair, to the outputs
    (kernels/int4_mma_gemv.py takes it as one packed register)."""
    base_bits, one_bits, fma = PAIR_CONSTANTS[dtype]
    return f"""
        {{
        .reg .b32 t, one, negzero;
        mov.b32 one, {one_bits};
        mov.b32 negzero, 0x80008000;
        lop3.b32 t, {word}, 0x000F000F, {base_bits}, 0xEA;
        {fma} t, t, one, $4;
        {fma} t, t, $3, negzero;
        {store}
        }}
        """


# $2 the shifted word; out $0 and $1, one 16-bit weight each
_BF16_PAIR = tl.constexpr(pair_ptx("bf16", "$2", "mov.b32 {$0, $1}, t;"))
_F16_PAIR = tl.constexpr(pair_ptx("fp16", "$2", "mov.b32 {$0, $1}, t;"))


@triton.jit
def _pair_bits(shifted, scale_pair, base_pair, ASM: tl.constexpr, DTYPE: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm=ASM.value,
        constraints="=h,=h,r,r,r",
        args=[shifted, scale_pair, base_pair],
        dtype=(DTYPE.value, DTYPE.value),
        is_pure=True,
        pack=1,
    )


@triton.jit
def dequantize_pair(words, P: tl.constexpr, scale_pair, base_pair, DTYPE: tl.constexpr):
    """Slices P and P + 4 (P = 0..3) of a [BLOCK_N, 32] tile of words as two [BLOCK_N, 32] weight tiles in
    DTYPE. scale_pair / base_pair: int32 [BLOCK_N] from `pack_pairs` (slice P's group in the low half)."""
    shifted = words >> (4 * P) if P > 0 else words
    if DTYPE.is_bf16():
        return _pair_bits(shifted, scale_pair[:, None], base_pair[:, None], _BF16_PAIR, DTYPE)
    else:
        return _pair_bits(shifted, scale_pair[:, None], base_pair[:, None], _F16_PAIR, DTYPE)


@triton.jit
def load_scale_zero_words(sz_ptr, group, N, offs_n, n_mask):
    """One group's (scale, zero point) pairs of BLOCK_N weight rows as int32 words (scale bits in the low
    half): one 4-byte load per row."""
    words = sz_ptr.to(tl.pointer_type(tl.int32)) + group * N + offs_n
    return tl.load(words, mask=n_mask, other=0)


@triton.jit
def _scale_and_base_bits(sz_word, DTYPE: tl.constexpr):
    """The scale's 16 bits and those of -(BASE + z), each in the low half of an int32."""
    zero = (sz_word >> 16).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    base = 128.0 if DTYPE.is_bf16() else 1024.0
    base_bits = (-(base + zero)).to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return sz_word & 0xFFFF, base_bits


@triton.jit
def pack_pairs(low_word, high_word, DTYPE: tl.constexpr):
    """(scale_pair, base_pair) for `dequantize_pair` from the scale / zero words of the low slice's group
    and the high slice's group."""
    low_scale, low_base = _scale_and_base_bits(low_word, DTYPE)
    high_scale, high_base = _scale_and_base_bits(high_word, DTYPE)
    return low_scale | (high_scale << 16), low_base | (high_base << 16)
