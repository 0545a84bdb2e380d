"""y = x @ W.T (+ bias) for 17 to 32 rows of x: a decode batch's linear layers, bound by reading W.

Past 16 rows, skinny_gemm's tile (32 weight rows against x padded to 16 rows, on Ampere-style MMAs)
stops paying: x grows as large as the weight slice each program reads. This kernel swaps the operands:
it computes y.T = W @ x.T, so the weight's rows are the MMA's long side (BLOCK_N = 64, which Hopper's
warpgroup MMAs take) and the batch is the short side (x padded to 32 rows). Each program streams
its BLOCK_N x K slice of W once in BLOCK_K chunks, NUM_STAGES loads in flight; x stays in the L2.
As skinny_gemm does, it launches with programmatic dependent launch and asks the L2 for the head of
its weight rows before waiting for the previous kernel (kernels/l2_prefetch.py).

On an H100 the decode graph's batch-24 and batch-32 steps are faster with it than on cuBLAS; past 32 rows
(x padded to 64) the step was slower (benchmarks/gpu/skinny_gemm.py and decode_graph.py; figures in
docs/performance.md, section "Serving: the batch-32 decode step").

Reference: torch.nn.functional.linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import kernel_capability, shared_memory_per_block
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.l2_prefetch import prefetch_row_heads, row_head_bytes
from fitserve.kernels.skinny_gemm import streams_rows

MIN_ROWS = 17  # up to 16 rows skinny_gemm is faster
# The smallest weights it takes (as skinny_gemm's before tensor-parallel shapes were measured there).
MIN_OUT_FEATURES = 4096
MIN_IN_FEATURES = 2048
MAX_ROWS = 32  # x's rows are padded to this many (one compiled variant)
# Weight rows a program: the warpgroup MMA's side. 32 (twice the programs for o_proj's 4,096 rows, on
# Ampere-style MMAs) made the batch-32 decode graph slower: 8.15 against 7.67 ms.
BLOCK_N = 64
BLOCK_K = 128
NUM_STAGES = 6
NUM_WARPS = 4
# one cp.async stage: x's [MAX_ROWS, BLOCK_K] and the weight's [BLOCK_N, BLOCK_K] (16-bit): 24 KB; a kernel
# of num_stages keeps num_stages - 1 (120 KB at 6), so GPUs of 99 KB a block (sm_86, sm_89) take fewer
STAGE_BYTES = (MAX_ROWS + BLOCK_N) * BLOCK_K * 2


def num_stages(shared_memory: int) -> int:
    """NUM_STAGES, or as many as a block's `shared_memory` (kernels/capability.py) holds, 4 KB to spare."""
    stages = NUM_STAGES
    while stages > 2 and (stages - 1) * STAGE_BYTES + 4096 > shared_memory:
        stages -= 1
    return stages


PREFETCH_ROW_BYTES = 2048
PREFETCH_PIECES = 2  # per weight row: 64 rows x 2 = one prefetch per thread of 4 warps


@fast_launch
@triton.jit(do_not_specialize=["M"])
def _swapped_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_BYTES: tl.constexpr,
    PREFETCH_PIECES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if USE_PDL and PREFETCH_BYTES > 0:  # weights are never written: safe before the wait
        prefetch_row_heads(w_ptr, pid, N, K, stride_wn, BLOCK_N, PREFETCH_BYTES, PREFETCH_PIECES)
    wait_for_previous_kernel(USE_PDL)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # N % BLOCK_N == 0 (supports)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)  # K % BLOCK_K == 0 (supports)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + (k + offs_k)[None, :])
        x = tl.load(x_rows + (k + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
    y = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[None, :])


def worth_it(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when swapped_gemm takes this call and beats cuBLAS on it (measured shapes, see above; the
    smallest weights as for skinny_gemm: enough programs to fill the GPU)."""
    return (
        x.shape[0] >= MIN_ROWS
        and weight.shape[0] >= MIN_OUT_FEATURES
        and weight.shape[1] >= MIN_IN_FEATURES
        and supports(x, weight)
    )


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when swapped_gemm can take this call (CUDA, 16-bit floats, at most 32 rows, whole tiles)."""
    return (
        streams_rows(x, weight, MAX_ROWS)
        and weight.shape[0] % BLOCK_N == 0
        and weight.shape[1] % BLOCK_K == 0
    )


def swapped_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> y [M, N] in x's dtype."""
    if not supports(x, weight):
        raise ValueError(
            f"swapped_gemm takes CUDA float16/bfloat16 x [M <= {MAX_ROWS}, K] and weight [N, K] with "
            f"contiguous rows, N a multiple of {BLOCK_N} and K of {BLOCK_K}; got x {tuple(x.shape)} "
            f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}: use torch.nn.functional.linear"
        )
    rows, in_features = x.shape
    out_features = weight.shape[0]
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    _swapped_gemm_kernel[(out_features // BLOCK_N,)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        NUM_STAGES=num_stages(shared_memory_per_block(kernel_capability(x.device))),
        PREFETCH_BYTES=row_head_bytes(weight, PREFETCH_ROW_BYTES, PREFETCH_PIECES),
        PREFETCH_PIECES=PREFETCH_PIECES,
        num_warps=NUM_WARPS,
        **pdl_kwargs(x.device),
    )
    return y
