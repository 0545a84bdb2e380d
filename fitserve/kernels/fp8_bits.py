"""float8 e4m3 <-> float in integer and fp16 operations, for GPUs where Triton has no e4m3 conversion, and
e4m3 -> bfloat16 in integer operations for fp8 weights and an e4m3 KV cache beside bfloat16 activations on
every GPU (`e4m3_as_stored`, `e4m3_bytes_to_bfloat16`: Triton's conversion runs on the conversion unit, too
slow to keep up with the bytes).

Triton converts to and from float8 e4m3 (its fp8e4nv type) only from compute capability 8.9 on. Below that
(sm_70 to sm_86) the KV cache keeps the same bytes (kernels/kv_format.py: what torch's float8_e4m3fn
holds), the launchers pass it viewed as uint8 (attention_inputs.kv_cache_for_kernels; from 8.9 on too
beside bfloat16 queries), and the kernels encode and decode the bytes with these functions: `to_cache` in
the cache writes, `stored_values` in the attention kernels' key and value loads (e4m3_bytes_to_bfloat16 or
e4m3_bytes_to_float16 on a GPU, e4m3_bits_to_float16 under the interpreter). For a cache of another dtype
both are the plain conversion, so the kernels compile to what they had before.

e4m3: sign bit, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 holds the subnormals (steps of
2**-9), no infinities, 0x7f and 0xff are NaN, the largest finite value is 448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import has_e4m3_conversion, kernel_capability
from fitserve.kernels.fast_launch import INTERPRETING

# Decode: the byte's exponent and mantissa bits placed under fp16's (bias 15) read as 2**-8 times the e4m3
# value, subnormals included (fp16's subnormal step, 2**-24 x 2**7, is e4m3's 2**-9 x 2**-8).
FP16_FROM_E4M3_FACTOR = tl.constexpr(256.0)
E4M3_MIN_NORMAL_BITS = tl.constexpr(121 << 23)  # float32 bits of 2**-6, the smallest normal e4m3
FLOAT32_INF_BITS = tl.constexpr(0x7F800000)  # above it (sign aside): NaN
_INTERPRETING = tl.constexpr(INTERPRETING)  # no inline PTX there
# fp8 weights beside bfloat16 activations, and an e4m3 KV cache beside bfloat16 queries, on a GPU come as
# bytes decoded by e4m3_bytes_to_bfloat16 in integer instructions, not Triton's e4m3 -> float16 -> bfloat16
# on the conversion unit (False: Triton's conversion from 8.9 on, for trials)
BF16_FROM_BYTES = True


@triton.jit
def e4m3_bits_to_float16(byte):
    """e4m3 bytes (uint8) -> float16, exact: shifts, one multiply by 2**8 and a select for NaN, no branch."""
    bits = byte.to(tl.uint32)
    magnitude = bits & 0x7F
    half_bits = ((bits & 0x80) << 8) | (magnitude << 7)
    scaled = half_bits.to(tl.uint16).to(tl.float16, bitcast=True)
    value = scaled * tl.full((), FP16_FROM_E4M3_FACTOR, tl.float16)
    return tl.where(magnitude == 0x7F, float("nan"), value)


def _e4m3_pairs_ptx(shift: int, factor: int, fma_type: str) -> str:
    """Inline PTX decoding four e4m3 bytes (one 32-bit register) into two pairs of 16-bit floats: each byte
    moved to the top of a 16-bit half (PRMT), its exponent and mantissa shifted right by `shift` under the
    format's own, its sign kept, then one multiply a pair by `factor` (a 16-bit float, repeated) with -0
    as the addend, so +-0 stays +-0."""
    magnitude = (0x7F00 >> shift) * 0x10001
    lines = [
        ".reg .b32 lo, hi, bits, factor, minus_zero;",
        f"mov.b32 factor, {factor * 0x10001:#010x};",
        "mov.b32 minus_zero, 0x80008000;",
        "prmt.b32 lo, $2, 0, 0x1404;",
        "prmt.b32 hi, $2, 0, 0x3424;",
    ]
    for half, out in (("lo", "$0"), ("hi", "$1")):
        lines += [
            f"shr.b32 bits, {half}, {shift};",
            f"and.b32 bits, bits, {magnitude:#010x};",
            f"and.b32 {half}, {half}, 0x80008000;",
            f"or.b32 {half}, {half}, bits;",
            f"fma.rn.{fma_type} {out}, {half}, factor, minus_zero;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


# bfloat16: the byte's exponent and mantissa placed under bfloat16's (bias 127) read as 2**-120 times the
# e4m3 value, subnormals included (bfloat16's subnormal step, 2**-133 x 2**4, is e4m3's 2**-9 x 2**-120),
# then one multiply by 2**120 (0x7B80) a pair
_E4M3_TO_BF16_PTX = tl.constexpr(_e4m3_pairs_ptx(4, 0x7B80, "bf16x2"))
# float16, as e4m3_bits_to_float16 reads them: 2**-8 times the value under fp16's exponent and mantissa,
# then one multiply by 2**8 (0x5C00) a pair
_E4M3_TO_FP16_PTX = tl.constexpr(_e4m3_pairs_ptx(1, 0x5C00, "f16x2"))


@triton.jit
def e4m3_bytes_to_bfloat16(byte):
    """e4m3 bytes (uint8) -> bfloat16 on a GPU of compute capability 8.0 or more (inline PTX: the
    interpreter cannot run it), exact for every finite value, in integer instructions and one bfloat16
    multiply a pair, where Triton's conversion (e4m3 -> float16 -> bfloat16) takes three conversions a
    pair on the GPU's conversion unit, a quarter of the integer rate; the NaN codes (0x7f, 0xff) decode
    as +-480, which no checkpoint's weight holds. Four bytes a 32-bit register in, two pairs out."""
    return tl.inline_asm_elementwise(
        _E4M3_TO_BF16_PTX, "=r,=r,r", [byte], dtype=tl.bfloat16, is_pure=True, pack=4
    )


@triton.jit
def e4m3_bytes_to_float16(byte):
    """e4m3 bytes (uint8) -> float16 on a GPU (inline PTX), exact for every finite value, the NaN codes
    as +-480 like e4m3_bytes_to_bfloat16: e4m3_bits_to_float16's decode in a third of its instructions,
    for GPUs without Triton's e4m3 conversion (below 8.9)."""
    return tl.inline_asm_elementwise(
        _E4M3_TO_FP16_PTX, "=r,=r,r", [byte], dtype=tl.float16, is_pure=True, pack=4
    )


@triton.jit
def float32_to_e4m3_bits(x):
    """float32 -> e4m3 bytes (uint8) as torch's .to(torch.float8_e4m3fn) and the GPUs' cvt.rn.satfinite
    give them: rounded to nearest even, a magnitude past 448 (inf too) saturated to +-448, NaN to 0x7f
    with its sign (the cache writes clamp to +-448 before, as quantize_kv does)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # normal: round the 23 mantissa bits to 3 (half to even; a carry moves into the exponent), then
    # rebias the exponent from 127 to 7: (exponent << 3 | mantissa) - (120 << 3)
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # subnormal (below 2**-6): |x| in steps of 2**-9, rounded to an integer by adding 2**23 (float32
    # addition rounds half to even); a magnitude that rounds up to 8 is 2**-6, the smallest normal's code
    steps = tl.abs(x) * 512.0 + 8388608.0
    subnormal = steps.to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where(magnitude < E4M3_MIN_NORMAL_BITS, subnormal, normal)
    code = tl.minimum(code, 0x7E)  # 448
    code = tl.where(magnitude > FLOAT32_INF_BITS, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def stored_values(stored, dtype: tl.constexpr):
    """Keys or values loaded from the cache, or fp8 weights, as `e4m3_as_stored` passed them, in `dtype`:
    e4m3 bytes (uint8) decoded on a GPU by e4m3_bytes_to_bfloat16 or e4m3_bytes_to_float16 (the NaN codes
    read as +-480), under the interpreter by e4m3_bits_to_float16; any other element converted."""
    if stored.dtype == tl.uint8:
        if dtype == tl.bfloat16 and not _INTERPRETING:
            values = e4m3_bytes_to_bfloat16(stored)
        elif dtype == tl.float16 and not _INTERPRETING:
            values = e4m3_bytes_to_float16(stored)
        else:
            values = e4m3_bits_to_float16(stored).to(dtype)
    else:
        values = stored.to(dtype)
    return values


@triton.jit
def to_cache(values, element_ty: tl.constexpr):
    """Values (float32 once scaled and clamped, for a float8 cache) as the cache's element type stores
    them: e4m3 bytes where the cache is viewed as uint8, else converted."""
    if element_ty == tl.uint8:
        return float32_to_e4m3_bits(values.to(tl.float32))
    return values.to(element_ty)


def e4m3_as_stored(
    data: torch.Tensor, device: torch.device, activations: torch.dtype | None = None
) -> torch.Tensor:
    """e4m3 data (fp8 weights, an e4m3 KV cache) as the kernels load it on `device` beside `activations`
    (or queries) of that dtype (None: none to decode for, as W8A8 and the cache writes): viewed as bytes
    (uint8), which `stored_values` decodes, where Triton converts no e4m3 (below 8.9) and for bfloat16 ones
    on a GPU (`decodes_bf16_from_bytes`); else as it is."""
    if not has_e4m3_conversion(kernel_capability(device)) or decodes_bf16_from_bytes(device, activations):
        return data.view(torch.uint8)
    return data


def decodes_bf16_from_bytes(device: torch.device, activations: torch.dtype | None) -> bool:
    """Whether kernels multiplying fp8 weights (or an e4m3 KV cache) with `activations` (or queries) take
    the bytes and decode them with e4m3_bytes_to_bfloat16 (BF16_FROM_BYTES): bfloat16 ones on a GPU of
    compute capability 8.0 or more (a forced target counts), not under the interpreter."""
    capability = kernel_capability(device)
    runs = BF16_FROM_BYTES and not _INTERPRETING and activations == torch.bfloat16
    return runs and capability is not None and capability >= (8, 0)
