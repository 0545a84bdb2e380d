"""Int4 weights dequantized to bfloat16 / float16 rows at full memory bandwidth, and the chunked int4
linear that prefill steps run on them: y = x @ W.T as cuBLAS GEMMs over chunks of W's rows, each chunk
first dequantized into a scratch buffer shared by every layer.

Why: the fused W4A16 kernels of kernels/int4_gemm.py win while a step streams the weight (1 to ~32 rows
of x), but from ~64 rows on they dequantize every weight tile once per row tile of x and lose 2-3x to a
bf16 cuBLAS GEMM (benchmarks/gpu/int4_gemm.py on an H100). Dequantizing W once per call costs a read of
the 4-bit weight (0.5 byte a weight) and a write of the 16-bit one (2 bytes), ~100 us for Llama-3.1-8B's
gate_up [28672 x 4096] at ~3 TB/s, after which the GEMM runs at bf16 speed.

`dequantize_rows(packed, row_start, row_count, out)`: W[row_start : row_start + row_count, :K] in the
packed dtype into `out` [row_count, K] (any row stride, unit column stride). A program owns BLOCK_N
weight rows and a run of 256-code blocks; per block it loads the rows' [BLOCK_N, 32] words (one 128-byte
line a row) and expands them to a [BLOCK_N, 8, 32] tile of codes with one shift and one AND per code:
index (j, i) of that tile is nibble j of word i, code k = 256 b + 32 j + i, so the tile read row-major is
the block's 256 codes in natural K order and is stored as 512 contiguous bytes a row (no reordering).
Each code becomes (q - z) * s in float32 (the group's scale and zero point as stored, in the activation
dtype), rounded once to the activation dtype. No host sync, no allocation: CUDA-graph safe. In the sm_90
PTX (compiled here, no GPU) the codes are computed in the store's layout, 16-byte stores (8 a thread a
block); only the small [BLOCK_N, 32] words and [BLOCK_N, 8] scales / zeros tiles change layout.
`dequant_config` (host) picks the tile: a fixed rule of the row count and K, constants below.

`chunked_int4_linear(x, packed, bias)`: chunks of C weight rows (C a multiple of 128 with C x K values at
most SCRATCH_BYTES; the whole of W when it fits), each dequantized into the scratch buffer and multiplied
by cuBLAS straight into its columns of y (torch.mm / torch.addmm with `out=` a strided view of y: cuBLAS
takes the row stride as the leading dimension, no copy). One chunk (W fits) is a plain F.linear.

The scratch buffer (`scratch_buffer`): one flat buffer of SCRATCH_BYTES per (device, dtype), shared by all
layers (they run one after the other on one stream), allocated lazily with torch.empty on first use. The
engine's memory profiling run (a dummy step at max_num_batched_tokens, worker/model_runner.py
`profile_run`) runs every layer with more rows than the fused kernels take, so it allocates the buffer
before the KV cache is sized and it is counted in the activation peak. (Were it first allocated while a
CUDA graph is captured it would come from the graph's private pool; it stays valid there as long as this
module holds it, but the profiling run makes that moot.)

Reference: `int4_repack.dequantize_packed` (scales and zero points as stored) and `dequantize_reference`.
Imports triton: CUDA code paths only. Under TRITON_INTERPRET=1 it runs on CPU tensors (slowly):
tests/unit/test_int4_dequant_interpret.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fitserve.kernels.fast_launch import INTERPRETING, host_launched
from fitserve.kernels.grid_math import cdiv
from fitserve.kernels.int4_gemm import int4_linear, sm_count, supports
from fitserve.kernels.int4_repack import BLOCK_K, PackedInt4

# First guesses, for the lead to sweep on the H100 (the dequantization is store-bound: 2 bytes written
# for every 0.5 byte read).
DEQUANT_BLOCK_N = 32  # weight rows a program; [32, 8, 32] codes a block over 4 warps: 64 a thread
DEQUANT_NUM_WARPS = 4
DEQUANT_PROGRAMS_PER_SM = 8  # give a program more blocks only while the grid keeps this many per SM
DEQUANT_MAX_BLOCKS_PER_PROGRAM = 4

SCRATCH_BYTES = 64 << 20  # the shared scratch buffer, per device and dtype
CHUNK_ALIGN = 128  # a chunk of several is a multiple of this many weight rows (the GEMM's tile)

_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@dataclass(frozen=True)
class DequantConfig:
    """One launch of the dequantization kernel."""

    block_n: int  # weight rows a program (a power of two)
    blocks_per_program: int  # 256-code blocks a program walks
    num_warps: int = DEQUANT_NUM_WARPS


@host_launched
@triton.jit(do_not_specialize=["row_start", "row_count"])
def _dequantize_rows_kernel(
    qw_ptr,
    sz_ptr,
    out_ptr,
    row_start,
    row_count,
    N,
    K,
    stride_qn,
    stride_out,
    group_size,
    blocks_per_program,
    BLOCK_N: tl.constexpr,
    GROUP_J: tl.constexpr,  # 32-code slices per group, at most 8 (a larger group spans whole blocks)
    EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    local = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of out
    in_rows = local < row_count
    row_mask = in_rows[:, None, None]
    rows = row_start + local  # rows of W
    offs_j = tl.arange(0, 8)
    offs_i = tl.arange(0, 32)
    # [BLOCK_N, 1, 32]: a block's 32 words a row; [BLOCK_N, 8, 32]: its 256 codes, natural K order
    words_at = qw_ptr + rows.to(tl.int64)[:, None, None] * stride_qn + offs_i[None, None, :]
    columns = (32 * offs_j)[None, :, None] + offs_i[None, None, :]
    out_at = out_ptr + local.to(tl.int64)[:, None, None] * stride_out + columns
    shifts = (4 * offs_j)[None, :, None]
    pair_rows = rows.to(tl.int64)[:, None] * 2
    num_blocks = tl.cdiv(K, 256)
    first = pid_k * blocks_per_program
    last = tl.minimum(first + blocks_per_program, num_blocks)
    for kb in range(first, last):
        words = tl.load(words_at + kb * 32, mask=row_mask, other=0)
        codes = ((words >> shifts) & 0xF).to(tl.float32)
        if GROUP_J < 8:
            group = kb * (8 // GROUP_J) + offs_j // GROUP_J
        else:
            group = (kb * 256) // group_size + offs_j * 0
        # the (scale, zero point) of each row and slice: [BLOCK_N, 8], small next to the codes
        pairs = sz_ptr + group.to(tl.int64)[None, :] * (2 * N) + pair_rows
        scale = tl.load(pairs, mask=in_rows[:, None], other=0.0).to(tl.float32)[:, :, None]
        zero = tl.load(pairs + 1, mask=in_rows[:, None], other=0.0).to(tl.float32)[:, :, None]
        w = ((codes - zero) * scale).to(out_ptr.dtype.element_ty)
        if EVEN_K:
            tl.store(out_at + kb * 256, w, mask=row_mask)
        else:
            tl.store(out_at + kb * 256, w, mask=row_mask & ((kb * 256 + columns) < K))


def dequant_config(row_count: int, in_features: int, sms: int) -> DequantConfig:
    """The dequantization tile for row_count weight rows of K = in_features: BLOCK_N rows a program, and
    as many 256-code blocks a program as keep DEQUANT_PROGRAMS_PER_SM programs per SM (at most
    DEQUANT_MAX_BLOCKS_PER_PROGRAM), spread evenly over K. A fixed rule: no autotuning at run time."""
    blocks = cdiv(in_features, BLOCK_K)
    tiles = cdiv(max(row_count, 1), DEQUANT_BLOCK_N) * blocks
    wanted = tiles // (DEQUANT_PROGRAMS_PER_SM * sms)
    per_program = max(1, min(DEQUANT_MAX_BLOCKS_PER_PROGRAM, blocks, wanted))
    per_program = cdiv(blocks, cdiv(blocks, per_program))  # the same number of blocks for every program
    return DequantConfig(block_n=DEQUANT_BLOCK_N, blocks_per_program=per_program)


def dequantize_rows(
    packed: PackedInt4,
    row_start: int,
    row_count: int,
    out: torch.Tensor,
    config: DequantConfig | None = None,
) -> torch.Tensor:
    """Writes W[row_start : row_start + row_count, :K] (packed's dtype) into out [row_count, K] (a
    caller's scratch view, unit column stride) and returns out. No host sync, no allocation."""
    in_features = packed.in_features
    if not (
        row_start >= 0
        and row_count >= 0
        and row_start + row_count <= packed.out_features
        and out.dim() == 2
        and tuple(out.shape) == (row_count, in_features)
        and out.dtype == packed.dtype
        and out.device == packed.device
        and (out.stride(1) == 1 or row_count == 0)
    ):
        raise ValueError(
            f"dequantize_rows writes rows [{row_start}, {row_start + row_count}) of a "
            f"[{packed.out_features}, {in_features}] weight into out [{row_count}, {in_features}] in "
            f"{packed.dtype} on {packed.device} with unit column stride; got out {tuple(out.shape)} "
            f"{out.dtype} on {out.device} (stride {out.stride()})"
        )
    if row_count == 0:
        return out
    if config is None:
        config = dequant_config(row_count, in_features, sm_count(out.device))
    blocks = cdiv(in_features, BLOCK_K)
    grid = (cdiv(row_count, config.block_n), cdiv(blocks, config.blocks_per_program))
    args = (
        packed.qweight,
        packed.scale_zero,
        out,
        row_start,
        row_count,
        packed.out_features,
        in_features,
        packed.qweight.stride(0),
        out.stride(0),
        packed.group_size,
        config.blocks_per_program,
    )
    constexprs = {
        "BLOCK_N": config.block_n,
        "GROUP_J": min(packed.group_size, BLOCK_K) // 32,
        "EVEN_K": in_features % BLOCK_K == 0,
    }
    if INTERPRETING:  # the interpreter runs the JIT function itself, without launch options
        _dequantize_rows_kernel[grid](*args, **constexprs)
    else:
        _dequantize_rows_kernel[grid](*args, **constexprs, num_warps=config.num_warps)
    return out


def scratch_buffer(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The flat scratch buffer of SCRATCH_BYTES for `device` and `dtype`, shared by every layer; allocated
    on first use (the profiling run's, module docstring)."""
    key = (torch.device(device), dtype)
    buffer = _scratch.get(key)
    if buffer is None:
        element_size = torch.empty((), dtype=dtype).element_size()
        buffer = torch.empty(SCRATCH_BYTES // element_size, dtype=dtype, device=device)
        _scratch[key] = buffer
    return buffer


def chunk_rows(
    out_features: int, in_features: int, element_size: int, scratch_bytes: int = SCRATCH_BYTES
) -> int:
    """Weight rows a chunk: all of them when W fits in scratch_bytes, else a multiple of CHUNK_ALIGN that
    fits, as even as that allows over the fewest chunks; 0 when not even CHUNK_ALIGN rows fit."""
    most = scratch_bytes // (in_features * element_size) // CHUNK_ALIGN * CHUNK_ALIGN
    if out_features * in_features * element_size <= scratch_bytes:
        return out_features
    if most == 0:
        return 0
    chunks = cdiv(out_features, most)
    return min(most, cdiv(cdiv(out_features, chunks), CHUNK_ALIGN) * CHUNK_ALIGN)


def chunked_int4_linear(
    x: torch.Tensor,
    packed: PackedInt4,
    bias: torch.Tensor | None = None,
    scratch_bytes: int = SCRATCH_BYTES,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) -> y [M, N] in x's dtype, by chunks of W's rows dequantized into the
    shared scratch buffer (module docstring). scratch_bytes caps a chunk below the buffer's size (for
    tests and sweeps). Falls back to int4_linear where no chunk of CHUNK_ALIGN rows fits."""
    if not supports(x, packed):
        raise ValueError(
            f"chunked_int4_linear takes x [M, {packed.in_features}] in {packed.dtype} with contiguous rows "
            f"on {packed.device}; got x {tuple(x.shape)} {x.dtype} on {x.device} (stride {x.stride()})"
        )
    out_features, in_features = packed.out_features, packed.in_features
    scratch = scratch_buffer(x.device, x.dtype)
    usable = min(scratch_bytes, scratch.numel() * scratch.element_size())
    chunk = chunk_rows(out_features, in_features, x.element_size(), usable)
    if chunk == 0 or x.shape[0] == 0:
        return int4_linear(x, packed, bias)
    if chunk >= out_features:  # W fits: one dequantization, one plain GEMM
        whole = scratch[: out_features * in_features].view(out_features, in_features)
        weight = dequantize_rows(packed, 0, out_features, whole)
        return F.linear(x, weight, bias)
    y = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    for start in range(0, out_features, chunk):
        count = min(chunk, out_features - start)
        part = scratch[: count * in_features].view(count, in_features)
        weight = dequantize_rows(packed, start, count, part)
        # cuBLAS writes y's columns in place: the view's row stride is the GEMM's leading dimension
        columns = y[:, start : start + count]
        if bias is None:
            torch.mm(x, weight.t(), out=columns)
        else:
            torch.addmm(bias[start : start + count], x, weight.t(), out=columns)
    return y
