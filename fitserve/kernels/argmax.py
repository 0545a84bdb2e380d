"""Row-wise argmax over the vocabulary: greedy sampling, and random sampling as a race.

torch.argmax reduces a row of logits in one pass: for one row of 128,256 float32 logits (the
Llama-3.1-8B vocabulary) it took 27 us on an H100, ~0.5% of a batch-1 decode step, for 0.5 MB. Here
each row is split into CHUNK-wide pieces, one program each keeps its piece's (max, first index), and a
second launch picks, per row, the piece with the largest max (the first such piece). Ties go to the
lowest index, as torch.argmax's do; a row of -inf gives index 0.

`race_rows` samples each row from softmax(x) in the same two launches: argmax over x - log(q) with q
~ Exp(1) drawn per element inside the kernel (Philox, from a seed read on the device), the exponential
race the sampler runs in torch as softmax, a tensor of Exp(1) draws, a division and an argmax: about
ten passes over [rows, vocab] float32 instead of one read. The draws are compute, not memory: at 256
rows of 151,936 they took 211 us against the greedy argmax's 30 us with 64-bit Philox counters, one
draw per call and exact logs; 32-bit counters, four draws a call and the approximate log2 fix that
(`benchmarks/gpu/sampler_kernels.py`).

Reference: torch.argmax(x, dim=-1); for race_rows, torch.multinomial(torch.softmax(x, -1), 1) in
distribution.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.libdevice import fast_log2f
from triton.language.random import philox, uint_to_uniform_float

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv, next_power_of_2

CHUNK = 4096
LN2: tl.constexpr = tl.constexpr(math.log(2.0))
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))


@fast_launch
@triton.jit
def _chunk_argmax_kernel(
    x_ptr,
    part_max_ptr,
    part_index_ptr,
    seed_ptr,
    scale_ptr,
    width,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    RACE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(x_ptr + row * stride_row + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
    if HAS_SCALE:  # a row's 1 / temperature (-inf stays -inf)
        values = values * tl.load(scale_ptr + row)
    if RACE:
        # x - ln(q), q = -ln(u) ~ Exp(1), taken in base 2 (x * log2(e) - log2(q): the same argmax) with
        # the GPU's approximate log2. u = 0 gives q = inf and drops the token, as a draw of probability
        # 0 should; -inf logits stay -inf. Philox runs on 32-bit counters (position in the row / 4, row)
        # and gives four draws a call: 64-bit counters and one draw a call took 7x the argmax's time.
        quarter = chunk * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
        zero = quarter * 0
        r0, r1, r2, r3 = philox(tl.load(seed_ptr), quarter, zero + tl.program_id(0), zero, zero)
        bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [CHUNK])
        uniform = uint_to_uniform_float(bits)
        log2_q = fast_log2f(-fast_log2f(uniform) * LN2)
        values = values * LOG2E - log2_q
    best, where = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(part_max_ptr + row * num_chunks + chunk, best)
    tl.store(part_index_ptr + row * num_chunks + chunk, chunk * CHUNK + where)


@fast_launch
@triton.jit
def _pick_chunk_kernel(
    part_max_ptr, part_index_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    maxima = tl.load(part_max_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=float("-inf"))
    _, chunk = tl.max(maxima, axis=0, return_indices=True, return_indices_tie_break_left=True)
    index = tl.load(part_index_ptr + row * num_chunks + chunk)
    tl.store(out_ptr + row, index.to(tl.int64))


def supports(x: torch.Tensor) -> bool:
    """True when argmax_rows takes x: a CUDA float tensor [rows >= 1, width >= 1], contiguous rows."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.shape[0] > 0
        and 0 < x.shape[1] < 2**31
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and x.stride(1) == 1
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, width] -> int64 [rows]: each row's index of its largest value (the first on ties)."""
    return _argmax(x, None)


def race_rows(x: torch.Tensor, seed: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, width] of logits (-inf for excluded tokens) -> int64 [rows], row r's token drawn with
    probability softmax(x[r] * scale[r]) (scale: float32 [rows], 1 / temperature; None: 1). seed: an
    int64 tensor of one element on x's device (read there, so drawing it from torch's generator needs
    no host sync). x is only read."""
    return _argmax(x, seed, scale)


def _argmax(x: torch.Tensor, seed: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    if not supports(x):
        raise ValueError(
            f"argmax_rows takes a CUDA float tensor [rows, width] with contiguous rows; got "
            f"{tuple(x.shape)} {x.dtype} on {x.device}: use torch.argmax"
        )
    rows, width = x.shape
    num_chunks = cdiv(width, CHUNK)
    part_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=x.device)
    part_index = torch.empty((rows, num_chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    launch = pdl_kwargs(x.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        x,
        part_max,
        part_index,
        seed if seed is not None else part_index,
        scale if scale is not None else part_max,
        width,
        x.stride(0),
        num_chunks,
        CHUNK=CHUNK,
        RACE=seed is not None,
        HAS_SCALE=scale is not None,
        num_warps=8,
        **launch,
    )
    block_chunks = max(16, next_power_of_2(num_chunks))
    _pick_chunk_kernel[(rows,)](
        part_max, part_index, out, num_chunks, BLOCK_CHUNKS=block_chunks, num_warps=1, **launch
    )
    return out
