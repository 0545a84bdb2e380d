"""y = x @ W.T (+ bias) for a bitsandbytes 4-bit weight (nf4 / fp4) in kernels/nf4_pack.PackedNf4: the
dequantize fused into the GEMM, for decode-sized row counts (layers/quantization/bnb_runtime.py sends more
rows to kernels/nf4_dequant.py's chunked dequantize + cuBLAS).

Up to MMA_MAX_ROWS rows on SM 8.0+ GPUs (`mma_kernel_ok`: absmax blocks of >= 64 codes, K a multiple of 256)
the register-fed tensor-core kernel runs (kernels/nf4_mma_gemv.py): on the H100 the four Llama-3.1-8B
layers at 1 row 67.6 us against 96.9 for the kernels below, at 8 rows 73.5 against 208.1
(benchmarks/results/h100_nf4_mma_gemv.json). The kernels below take every other case.

A program owns BLOCK_N weight rows and a range of K (split-K); a step covers BLOCK_K codes (BLOCK_K
divides the block size, so one absmax a weight row a step). It loads the rows' codes as bytes [BLOCK_N,
BLOCK_K / 2] (a row's bytes are contiguous) and turns each byte into the values of its two codes
(`_byte_values`): nf4's 16 values are not evenly spaced, so there is no affine trick as for int4. The
default up to 16 rows on a GPU (LOOKUP 4) picks each value's float16 bytes with byte permutes (inline PTX,
`_permuted_values`); for more rows and under the interpreter (LOOKUP 3) tl.gather from the 16 values held
in registers (a shuffle a code); a tree of 15 selects (LOOKUP 2) and gathers from memory (the pair table,
LOOKUP 0, or the 16-entry table, LOOKUP 1) measured 2.1x to 10x slower on the H100 (see LOOKUP). x is
read as its even and odd columns to match.

- `_nf4_gemv_kernel` (1 row, CUDA cores): products scaled elementwise by the row's absmax into a float32
  [BLOCK_N, BLOCK_K / 2] accumulator, summed over its columns once at the end.
- `_nf4_dot_kernel` (2 and more rows, tensor cores): w = value * absmax rounded to x's dtype, then two
  tl.dot of depth BLOCK_K / 2 (even columns, odd columns) into a float32 [BLOCK_M, BLOCK_N] tile.

Split-K as in kernels/int4_gemm.py (kernels/int4_kernel_parts.py `_finish`: partials in a workspace, the
last program of a tile sums them in split order, deterministic, no host sync), so calls can be captured in
CUDA graphs.
Measured on the H100 (benchmarks/gpu/nf4_gemm.py, benchmarks/results/h100_nf4_gemm.json): at batch 1 the
four Llama-3.1-8B layers take ~1.35x less time than bf16's, short of the 2x the 4-bit bytes allow. A
step over several blocks (each column's absmax taken by tl.gather from a [BLOCK_N, blocks] tile) measured
no faster in a sweep of tiles and crashed Triton's TritonGPUOptimizeThreadLocality pass for some. The
byte-permute lookup (LOOKUP 4) and one-row splits of at least GEMV_MIN_STEPS steps took the four layers
at one row from 116.0 to 97.3 us (two H100 leases, h100_nf4_permute_lookup.json).

Reference: nf4_pack.dequantize_packed, then x.float() @ W.T. Under TRITON_INTERPRET=1 this runs on CPU
tensors (tests/unit/test_nf4_gemm_interpret.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import kernel_capability, sm_count
from fitserve.kernels.dependent_launch import pdl_kwargs
from fitserve.kernels.fast_launch import INTERPRETING
from fitserve.kernels.grid_math import cdiv, even_splits, next_power_of_2
from fitserve.kernels.int4_kernel_parts import _finish
from fitserve.kernels.nf4_pack import PackedNf4

try:
    from fitserve.kernels.nf4_mma_gemv import BLOCK_CODES, GROUP_CODES, _nf4_mma_gemv_kernel
except ImportError:  # a Triton without Gluon's mma_v2 (before 3.6): the other kernels take every row count
    _nf4_mma_gemv_kernel = None

# Nf4Config.lookup's default past PERMUTE_MAX_ROWS rows: tl.gather from the 16 values held in registers.
# On the H100 (benchmarks/gpu/nf4_gemm.py, Llama-3.1-8B shapes, block 64, 1 row) qkv / o / gate_up / down
# took 16 / 12 / 59 / 31 us with it, against 35 / 23 / 136 / 76 us for the select tree, 155 / 98 / 605 /
# 335 us for the pair-table gather, and bf16's 21 / 9 / 80 / 40 us; at 16 rows qkv 40 us against 55
# (select tree).
LOOKUP = 3
# Up to PERMUTE_MAX_ROWS rows on GPUs: byte permutes (LOOKUP 4, inline PTX), no shuffles. On the H100
# (benchmarks/gpu/batch1_split_sweep.py --nf4 --nf4-lookups 3 4 [--rows 4 / 16],
# h100_nf4_permute_lookup.json), one row, each layer at its best split: qkv 15.3 -> 13.8 us, o 12.0 ->
# 11.3, gate_up 53.1 -> 47.0, down 28.2 -> 26.4; the tensor-core kernel at 4 rows: 27.7 -> 22.9, 19.9 ->
# 16.6, 106.1 -> 85.0, 55.2 -> 45.3 (16 rows: 37.2 -> 31.9, 26.4 -> 23.1, 152.1 -> 130.7, 78.4 -> 67.8).
# Past 16 rows not measured.
PERMUTE_LOOKUP = 3 if INTERPRETING else 4
PERMUTE_MAX_ROWS = 16
# Up to MMA_MAX_ROWS rows on SM 8.0+ GPUs, where `mma_kernel_ok`: the register-fed tensor-core kernel
# (kernels/nf4_mma_gemv.py), one 256-code block a loop step, split-K into even parts of at least
# MMA_MIN_BLOCKS_PER_SPLIT blocks with up to MMA_PROGRAMS_PER_SM programs an SM and at most MMA_MAX_SPLITS
# splits. The H100 sweep (benchmarks/gpu/nf4_mma_gemv.py --sweep, Llama-3.1-8B, 1 and 4 rows, 132 SMs) found
# qkv / o / gate_up / down fastest at 8 / 8 / 2 / 8 splits of 64-row tiles (gate_up 31.8 against 35.4 us
# unsplit, qkv 10.3 against 10.8 at 4 splits): the rule gives those.
MMA_MAX_ROWS = 8
MMA_BLOCK_N = 64  # 4 warps of one 16-row tile (the sweep's best or within 2% at 1 and 4 rows)
MMA_DECODE = True
MMA_PROGRAMS_PER_SM = 8
MMA_MAX_SPLITS = 8
MMA_MIN_BLOCKS_PER_SPLIT = 2
PROGRAMS_PER_SM = 4  # split K until the grid has about this many programs per SM
# ... and for one row: as many splits as keep <= GEMV_PROGRAMS_PER_SM programs an SM with at least
# GEMV_MIN_STEPS steps each, in equal parts (kernels/grid_math.even_splits). From the same sweep: within
# 1% of each layer's fastest split (qkv 8, o 8, gate_up 4, down 16 at 132 SMs).
GEMV_PROGRAMS_PER_SM = 16
GEMV_MIN_STEPS = 8
MIN_STEPS_PER_SPLIT = 2
MAX_SPLITS = 16
SPLIT_MAX_ROWS = 64


@dataclass(frozen=True)
class Nf4Config:
    kernel: str  # "gemv", "dot" or "mma" (block_k 256, block_n 16 x num_warps x row tiles per warp)
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    # code -> value (_byte_values): 0 pair-table gather, 1 two table gathers, 2 select tree, 3 tl.gather
    lookup: int = LOOKUP


@triton.jit
def _pair_values(bytes_, table_ptr):
    """Codes as bytes -> (even column's value, odd column's value), float32, from the pair table."""
    pairs = tl.load(table_ptr + bytes_.to(tl.int32))
    even = pairs.to(tl.int32).to(tl.float32, bitcast=True)
    odd = (pairs >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def _select16(c, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15):
    """code value of 4-bit codes c (int32) by a tree of selects over the 16 table values (no memory)."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    b3 = (c & 8) != 0
    v0 = tl.where(b1, tl.where(b0, t3, t2), tl.where(b0, t1, t0))
    v1 = tl.where(b1, tl.where(b0, t7, t6), tl.where(b0, t5, t4))
    v2 = tl.where(b1, tl.where(b0, t11, t10), tl.where(b0, t9, t8))
    v3 = tl.where(b1, tl.where(b0, t15, t14), tl.where(b0, t13, t12))
    return tl.where(b3, tl.where(b2, v3, v2), tl.where(b2, v1, v0))


def _four_codes(source: str, even: tuple[int, int], odd: tuple[int, int]) -> str:
    """PTX for the 4 codes in the low 16 bits of `source`: nibble k's value from the tables ($9, $13, ...
    $37: each table argument comes as 4 operands, one per packed element, all the same register)."""
    return f"""
        and.b32 s, {source}, 0x7777;
        shr.b32 u, {source}, 1;
        and.b32 u, u, 0x4444;
        or.b32 u, u, 0x3210;
        prmt.b32 la, $9, $13, s;
        prmt.b32 lb, $17, $21, s;
        prmt.b32 ha, $25, $29, s;
        prmt.b32 hb, $33, $37, s;
        prmt.b32 lo, la, lb, u;
        prmt.b32 hi, ha, hb, u;
        prmt.b32 p, lo, hi, 0x5140;
        prmt.b32 q, lo, hi, 0x7362;
        mov.b32 {{h0, h1}}, p;
        mov.b32 {{h2, h3}}, q;
        cvt.f32.f16 ${odd[0]}, h0;
        cvt.f32.f16 ${even[0]}, h1;
        cvt.f32.f16 ${odd[1]}, h2;
        cvt.f32.f16 ${even[1]}, h3;"""


# LOOKUP 4: 4 code bytes ($8) -> the float32 values of their even codes ($0..$3, high nibbles) and odd
# codes ($4..$7). Per 4 codes, PRMTs pick each value's low and high float16 byte from entries 0-7 and
# 8-15 (selector: the code & 7), one more PRMT each keeps the half that bit 3 names, two interleave them
# into float16 pairs, widened to float32: ALU instructions only, where tl.gather (LOOKUP 3) spends a
# shuffle on every code.
_PERMUTE_LOOKUP = tl.constexpr(
    "{\n.reg .b32 s, u, la, lb, ha, hb, lo, hi, p, q, w;\n.reg .b16 h0, h1, h2, h3;"
    + _four_codes("$8", (0, 1), (4, 5))
    + "\nshr.b32 w, $8, 16;"
    + _four_codes("w", (2, 3), (6, 7))
    + "\n}"
)


# 8 outputs, the packed bytes, then each table word 4 times (pack=4 gives a 32-bit argument one operand
# per element)
_PERMUTE_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 33))


@triton.jit
def _permuted_values(bytes_, tables_ptr):
    """LOOKUP 4 over a tile of code bytes, the 8 table words read from tables_ptr (int32 [8])."""
    return tl.inline_asm_elementwise(
        asm=_PERMUTE_LOOKUP.value, constraints=_PERMUTE_CONSTRAINTS.value,
        args=[
            bytes_, tl.load(tables_ptr), tl.load(tables_ptr + 1), tl.load(tables_ptr + 2),
            tl.load(tables_ptr + 3), tl.load(tables_ptr + 4), tl.load(tables_ptr + 5),
            tl.load(tables_ptr + 6), tl.load(tables_ptr + 7),
        ],
        dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _byte_values(bytes_, table_ptr, code_ptr, LOOKUP: tl.constexpr):
    """(even, odd) float32 code values of a tile of code bytes: LOOKUP 0 one 8-byte gather a byte from the
    pair table, 1 two 4-byte gathers from the 16-entry table, 2 a select tree (no gathers), 3 tl.gather
    from the 16 values held in registers (LOOKUP), 4 byte permutes, table_ptr then being
    PackedNf4.permute_table (PERMUTE_LOOKUP, up to PERMUTE_MAX_ROWS rows on GPUs)."""
    if LOOKUP == 0:
        even, odd = _pair_values(bytes_, table_ptr)
    elif LOOKUP == 4:  # table_ptr: PackedNf4.permute_table
        even, odd = _permuted_values(bytes_, table_ptr)
    elif LOOKUP == 3:  # tl.gather from the table held in registers (broadcast to every row)
        codes = bytes_.to(tl.int32)
        table = tl.load(code_ptr + tl.arange(0, 16))
        rows: tl.constexpr = bytes_.shape[0]
        src = tl.broadcast_to(table[None, :], (rows, 16))
        even = tl.gather(src, codes >> 4, 1)
        odd = tl.gather(src, codes & 15, 1)
    elif LOOKUP == 1:
        codes = bytes_.to(tl.int32)
        even = tl.load(code_ptr + (codes >> 4))
        odd = tl.load(code_ptr + (codes & 15))
    else:
        codes = bytes_.to(tl.int32)
        t0 = tl.load(code_ptr)
        t1 = tl.load(code_ptr + 1)
        t2 = tl.load(code_ptr + 2)
        t3 = tl.load(code_ptr + 3)
        t4 = tl.load(code_ptr + 4)
        t5 = tl.load(code_ptr + 5)
        t6 = tl.load(code_ptr + 6)
        t7 = tl.load(code_ptr + 7)
        t8 = tl.load(code_ptr + 8)
        t9 = tl.load(code_ptr + 9)
        t10 = tl.load(code_ptr + 10)
        t11 = tl.load(code_ptr + 11)
        t12 = tl.load(code_ptr + 12)
        t13 = tl.load(code_ptr + 13)
        t14 = tl.load(code_ptr + 14)
        t15 = tl.load(code_ptr + 15)
        even = _select16(codes >> 4, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
        odd = _select16(codes & 15, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
    return even, odd


@triton.jit(do_not_specialize=["M"])
def _nf4_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    table_ptr,
    code_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    blocksize,
    steps_per_split,
    num_splits,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides blocksize: one absmax a weight row a step
    LOOKUP: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """One row of x: per step the products of BLOCK_K codes, scaled elementwise by the row's absmax into
    a float32 [BLOCK_N, BLOCK_K / 2] accumulator, summed over its columns once at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, HALF)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    groups = K // blocksize
    acc = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, K // BLOCK_K)
    w_rows = w_ptr + rows[:, None] * (K // 2) + offs_b[None, :]
    s_rows = s_ptr + rows * groups
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        codes = tl.load(w_rows + step * HALF, mask=n_mask[:, None], other=0)
        even, odd = _byte_values(codes, table_ptr, code_ptr, LOOKUP)
        x_even = tl.load(x_ptr + step * BLOCK_K + 2 * offs_b).to(tl.float32)
        x_odd = tl.load(x_ptr + step * BLOCK_K + 2 * offs_b + 1).to(tl.float32)
        scale = tl.load(s_rows + (step * BLOCK_K) // blocksize, mask=n_mask, other=0.0).to(tl.float32)
        acc += (even * x_even[None, :] + odd * x_odd[None, :]) * scale[:, None]
    out = tl.sum(acc, axis=1)[None, :]
    offs_m = tl.arange(0, 1)
    _finish(
        out, offs_m, offs_n, M, N, y_ptr, stride_ym, bias_ptr, part_ptr, counter_ptr + pid_n, pid_k,
        num_splits, HAS_BIAS, SPLIT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _nf4_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    table_ptr,
    code_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    blocksize,
    steps_per_split,
    num_splits,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides blocksize: one absmax a weight row a step
    LOOKUP: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    HALF: tl.constexpr = BLOCK_K // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, HALF)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    groups = K // blocksize
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, K // BLOCK_K)
    for step in tl.range(first, last, num_stages=NUM_STAGES):
        byte_at = step * HALF + offs_b
        codes = tl.load(w_ptr + rows[:, None] * (K // 2) + byte_at[None, :], mask=n_mask[:, None], other=0)
        even, odd = _byte_values(codes, table_ptr, code_ptr, LOOKUP)
        scale = tl.load(s_ptr + rows * groups + (step * BLOCK_K) // blocksize, mask=n_mask, other=0.0)
        scale = scale.to(tl.float32)[:, None]
        w_even = (even * scale).to(dtype)
        w_odd = (odd * scale).to(dtype)
        x_even = tl.load(x_rows + 2 * byte_at[None, :], mask=m_mask[:, None], other=0.0)
        x_odd = tl.load(x_rows + 2 * byte_at[None, :] + 1, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x_even, tl.trans(w_even), acc)
        acc = tl.dot(x_odd, tl.trans(w_odd), acc)
    _finish(
        acc, offs_m, offs_n, M, N, y_ptr, stride_ym, bias_ptr, part_ptr, counter_ptr + pid, pid_k,
        num_splits, HAS_BIAS, SPLIT,
    )  # fmt: skip


def choose_config(
    rows: int, out_features: int, in_features: int, blocksize: int, sms: int, mma: bool = False
) -> Nf4Config:
    """A fixed rule of the shape (no autotuning: fitserve captures CUDA graphs); first guesses for an
    H100 sweep. `mma`: the register-fed tensor-core kernel may run (`mma_kernel_ok`)."""
    if mma and rows <= MMA_MAX_ROWS:
        blocks = in_features // BLOCK_CODES
        tiles = cdiv(out_features, MMA_BLOCK_N)
        most = min(MMA_PROGRAMS_PER_SM * sms // tiles, MMA_MAX_SPLITS)
        splits = even_splits(blocks, most, MMA_MIN_BLOCKS_PER_SPLIT)
        return Nf4Config("mma", MMA_MAX_ROWS, MMA_BLOCK_N, BLOCK_CODES, splits, num_warps=MMA_BLOCK_N // 16)
    if rows == 1:
        # the H100 sweep (Llama-3.1-8B shapes, block 64): 64 rows on 2 warps, 3 stages within 5% of the best
        kernel, block_m, block_n, block_k, warps = "gemv", 1, 64, min(blocksize, 128), 2
    elif rows <= 16:
        kernel, block_m, block_n, block_k, warps = "dot", 16, 64, min(blocksize, 128), 4
    elif rows <= 64:
        kernel, block_m, block_n, block_k, warps = "dot", next_power_of_2(rows), 64, min(blocksize, 128), 4
    else:
        kernel, block_m, block_n, block_k, warps = "dot", 64, 128, min(blocksize, 128), 8
    steps = cdiv(in_features, block_k)
    tiles = cdiv(rows, block_m) * cdiv(out_features, block_n)
    splits = 1
    if kernel == "gemv" and tiles <= cdiv(out_features, 16) * 8:
        splits = even_splits(steps, min(GEMV_PROGRAMS_PER_SM * sms // tiles, MAX_SPLITS), GEMV_MIN_STEPS)
    elif rows <= SPLIT_MAX_ROWS and tiles <= cdiv(out_features, 16) * 8:
        splits = max(1, min(cdiv(PROGRAMS_PER_SM * sms, tiles), MAX_SPLITS, steps // MIN_STEPS_PER_SPLIT))
        splits = cdiv(steps, cdiv(steps, splits))  # no empty split
    lookup = PERMUTE_LOOKUP if rows <= PERMUTE_MAX_ROWS else LOOKUP
    return Nf4Config(kernel, block_m, block_n, block_k, splits, num_warps=warps, lookup=lookup)


def supports(x: torch.Tensor, packed: PackedNf4) -> bool:
    return (
        (x.is_cuda or INTERPRETING)
        and x.dim() == 2
        and x.shape[1] == packed.in_features
        and x.dtype == packed.dtype
        and x.device == packed.device
        and x.stride(1) == 1
    )


def mma_kernel_ok(x: torch.Tensor, packed: PackedNf4) -> bool:
    """True when the register-fed tensor-core kernel (kernels/nf4_mma_gemv.py) may take x (which `supports`
    took): compiled for an SM 8.0+ GPU (not the interpreter), absmax blocks of at least 64 codes, K a
    multiple of 256 codes, and x's rows at 4-byte boundaries (it reads x in 16-bit pairs)."""
    if not MMA_DECODE or _nf4_mma_gemv_kernel is None or INTERPRETING:
        return False
    return (
        packed.blocksize >= GROUP_CODES
        and packed.in_features % BLOCK_CODES == 0
        and x.stride(0) % 2 == 0
        and x.data_ptr() % 4 == 0
        and packed.packed.data_ptr() % 4 == 0
        and kernel_capability(x.device) >= (8, 0)
    )


def nf4_linear(
    x: torch.Tensor, packed: PackedNf4, bias: torch.Tensor | None = None, config: Nf4Config | None = None
) -> torch.Tensor:
    """x [M, K] (bfloat16 / float16) @ W.T (+ bias [N]) -> y [M, N] in x's dtype."""
    if not supports(x, packed):
        raise ValueError(
            f"nf4_linear takes CUDA x [M, {packed.in_features}] in {packed.dtype} with unit column stride on "
            f"{packed.device}; got x {tuple(x.shape)} {x.dtype} on {x.device} (stride {x.stride()})"
        )
    rows, in_features = x.shape
    out_features = packed.out_features
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    mma = mma_kernel_ok(x, packed)
    if config is None:
        config = choose_config(rows, out_features, in_features, packed.blocksize, sm_count(x.device), mma)
    elif config.kernel == "mma" and (
        not mma
        or rows > MMA_MAX_ROWS
        or config.block_m != MMA_MAX_ROWS
        or config.block_n % (16 * config.num_warps)
    ):
        raise ValueError(
            f"nf4 GEMM config {config}: the mma kernel takes up to {MMA_MAX_ROWS} rows (here {rows}) with "
            f"block_m {MMA_MAX_ROWS} on an SM 8.0+ GPU, absmax blocks of >= {GROUP_CODES} codes (here "
            f"{packed.blocksize}), K a multiple of {BLOCK_CODES} (here {in_features}) and block_n 16 x "
            "num_warps x row tiles; use kernel 'gemv' or 'dot'"
        )
    steps = cdiv(in_features, config.block_k)
    tiles_n = cdiv(out_features, config.block_n)
    tiles = tiles_n * (cdiv(rows, config.block_m) if config.kernel == "dot" else 1)
    splits = config.split_k
    if splits > 1 and tiles > packed.counters.numel():
        raise ValueError(f"split-K over {tiles} tiles needs more than {packed.counters.numel()} counters")
    workspace = (
        torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device) if splits > 1 else y
    )
    if config.kernel == "mma":
        _launch_mma(x, packed, bias, y, workspace, config)
        return y
    args = (
        x, packed.packed, packed.scales, packed.permute_table if config.lookup == 4 else packed.pair_table,
        packed.code,
        bias if bias is not None else packed.scales, y,
        workspace, packed.counters, rows, out_features, in_features, x.stride(0), y.stride(0),
        packed.blocksize, cdiv(steps, splits), splits,
    )  # fmt: skip
    options = {} if INTERPRETING else {"num_warps": config.num_warps}
    if config.lookup == 4 and INTERPRETING:
        raise ValueError("nf4 lookup 4 is inline PTX: it runs compiled for a GPU, not under TRITON_INTERPRET")
    if config.kernel == "gemv":
        _nf4_gemv_kernel[(tiles_n, splits)](
            *args, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            LOOKUP=config.lookup, SPLIT=splits > 1, NUM_STAGES=config.num_stages, **options,
        )  # fmt: skip
    else:
        _nf4_dot_kernel[(tiles, splits)](
            *args, HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, LOOKUP=config.lookup, SPLIT=splits > 1,
            NUM_STAGES=config.num_stages, **options,
        )  # fmt: skip
    return y


def _launch_mma(
    x: torch.Tensor,
    packed: PackedNf4,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    workspace: torch.Tensor,
    config: Nf4Config,
) -> None:
    """kernels/nf4_mma_gemv.py (the codes read as int32 words, 8 codes a word)."""
    rows, in_features = x.shape
    blocks = in_features // BLOCK_CODES
    splits = cdiv(blocks, cdiv(blocks, min(config.split_k, blocks)))  # no empty split
    blocks_per_split = cdiv(blocks, splits)
    _nf4_mma_gemv_kernel[(cdiv(packed.out_features, config.block_n), splits)](
        x, packed.packed.view(torch.int32), packed.scales, bias if bias is not None else packed.scales, y,
        workspace, packed.counters, packed.mma_table, rows, packed.out_features, in_features, x.stride(0),
        y.stride(0), in_features // 8, packed.scales.stride(0), blocks_per_split, splits,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
        ROW_TILES=config.block_n // (16 * config.num_warps), BLOCKSIZE=packed.blocksize,
        SPLIT=splits > 1, num_warps=config.num_warps,
        **pdl_kwargs(x.device),
    )  # fmt: skip
