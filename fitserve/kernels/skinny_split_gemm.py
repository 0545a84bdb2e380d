"""y = x @ W.T (+ bias) for 1 to 16 rows of x and a weight of few output features: split over K.

kernels/skinny_gemm.py gives each program BLOCK_N output features and all of K, so only weights of
N >= 4096 make enough programs to keep every SM reading. Below that (an MoE's router and shared expert,
o_proj / out_proj of hidden 2048, k and v projections) cuBLAS takes several times what reading
the weight once needs at the copy bandwidth (benchmarks/gpu/skinny_gemm.py --split). Here each program
owns BLOCK_N output features and one range of K (grid: N tiles x splits): it streams its BLOCK_N x range
slice of W in BLOCK_K chunks and multiplies on the tensor cores with x padded to BLOCK_M rows, as
skinny_gemm does. `choose_splits` splits K into about equal ranges until the grid holds about
`programs_per_sm` programs an SM.

The splits meet without a second kernel (kernels/int4_kernel_parts.py `_finish`, as int4_gemm and
fp8_w8a16 do): each stores its float32 partial tile in a workspace [splits, M, N], bumps its N tile's
counter, and the program that arrives last sums the partials in split order (deterministic whoever
arrives last), adds the bias, writes y in x's dtype and resets the counter for the next call. The counters
are one int32 per N tile in a buffer per device (`_counters`), allocated at the first call, which must
not be inside a CUDA graph capture (the model runner's warm-up comes first). Every split-K call on a
device shares them, so two must not run at once on two streams; one stream's calls are ordered (with
programmatic dependent launch a program touches them only after wait_for_previous_kernel, when the
previous grid is complete). No host sync, launches depend on shapes only: CUDA graphs capture it.

Before its wait each program asks the L2 for the head of its own K range of its weight rows
(kernels/l2_prefetch.py): at these sizes that is most of the weight, fetched while the previous kernel
runs. Which shapes take this kernel: `worth_it` (layers/linear.py). Reference: torch.nn.functional.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import sm_count
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv, even_splits
from fitserve.kernels.int4_kernel_parts import _finish
from fitserve.kernels.l2_prefetch import prefetch_to_l2, row_head_bytes
from fitserve.kernels.skinny_gemm import MAX_ROWS, supports
from fitserve.kernels.split_counters import device_counters

# Which weights come here (`worth_it`), from benchmarks/gpu/skinny_gemm.py --split on an H100
# (benchmarks/results/h100_skinny_split_gemm.json): at most MAX_OUT_FEATURES output features, at least
# MIN_IN_FEATURES columns (two BLOCK_K steps of the default tile to split) and MIN_WEIGHT_ELEMENTS values
# (Gemma-4's router, 128 x 2816: 5.2 -> 3.6 us). N 256-2048 ran 1.1-1.5x faster than cuBLAS at 1 and 4 rows
# (Qwen3.6-35B-A3B's router, shared expert, k/v, o and out_proj; Llama-3.1-8B's k/v); the one loss, Gemma-4's
# k/v 2048 x 2816, was 3% (8.6 against 8.3 us). N 2816 (Gemma-4's o and down) ran 0.85-0.90x cuBLAS, which
# reads those at 0.54-0.78 of the copy bandwidth, and a Gemma-4 26B-A4B token with them routed here took 7%
# longer (228.8 against 246.4 tok/s): they stay on cuBLAS.
MAX_OUT_FEATURES = 2048
MIN_IN_FEATURES = 512
MIN_WEIGHT_ELEMENTS = 1 << 18
# Counters a device holds: one per N tile, so split-K up to COUNTER_SLOTS tiles (N 65,536 at BLOCK_N 16);
# a call with more tiles runs unsplit.
COUNTER_SLOTS = 4096
# BLOCK_K steps of each of its weight rows, from the start of its K range (clamped to the range's last
# step), that a program asks the L2 for before waiting for the previous kernel (programmatic dependent
# launch only; one prefetch instruction each, a power of two; 0 turns it off): 2 KB a row at BLOCK_K 256,
# skinny_gemm's PREFETCH_ROW_BYTES.
PREFETCH_STEPS = 4


@dataclass(frozen=True)
class SplitGemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4  # split K until the grid holds about this many programs an SM
    min_steps_per_split: int = 1  # BLOCK_K steps a split streams at least


# Candidates for benchmarks/gpu/skinny_gemm.py --split-configs. On the H100 (h100_skinny_split_gemm.json)
# n32k256 was the fastest or within 0.31 us of it on every taken weight but Gemma-4's k / v 2048 x 2816
# (n32k128 7.8 against 8.6 us): one config, one compiled variant per dtype and bias.
# 4 warps, BLOCK_M 16: a stage is (16 + BLOCK_N) x BLOCK_K x 2 bytes (24 KB for 32 x 256), and a program of
# num_stages keeps num_stages - 1 of them, so four programs share an H100 SM.
CONFIGS: dict[str, SplitGemmConfig] = {
    "n32k256": SplitGemmConfig(block_n=32, block_k=256, num_warps=4, num_stages=3),
    "n16k256": SplitGemmConfig(block_n=16, block_k=256, num_warps=4, num_stages=3),
    "n32k128": SplitGemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4),
    "n64k128x2": SplitGemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2),
}
DEFAULT_CONFIG = CONFIGS["n32k256"]


# Neither the row count nor the split sizes are specialized on: one variant per tile, dtype and bias.
@fast_launch
@triton.jit(do_not_specialize=["M", "steps_per_split", "num_splits"])
def _skinny_split_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    steps_per_split,
    num_splits,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_start = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_start + steps_per_split * BLOCK_K, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if USE_PDL and PREFETCH_STEPS > 0:  # weights are never written: safe before the wait
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        cols = tl.minimum(k_start + tl.arange(0, PREFETCH_STEPS) * BLOCK_K, k_end - BLOCK_K)
        addresses = (w_ptr + rows[:, None] * stride_wn + cols[None, :]).to(tl.int64)
        prefetch_to_l2(addresses, tl.full([BLOCK_N, PREFETCH_STEPS], BLOCK_K * 2, tl.int32))
    wait_for_previous_kernel(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = (k + offs_k) < k_end
        w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + (k + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
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


def worth_it(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when skinny_split_gemm takes this call in place of cuBLAS: a weight `takes_weight` takes and
    an x skinny_gemm's kernel could take (`supports`)."""
    return takes_weight(weight.shape[0], weight.shape[1]) and supports(x, weight)


def takes_weight(out_features: int, in_features: int) -> bool:
    """The shape rule: at most MAX_OUT_FEATURES rows, at least MIN_IN_FEATURES columns and
    MIN_WEIGHT_ELEMENTS values."""
    return (
        out_features <= MAX_OUT_FEATURES
        and in_features >= MIN_IN_FEATURES
        and out_features * in_features >= MIN_WEIGHT_ELEMENTS
    )


def choose_splits(out_features: int, in_features: int, config: SplitGemmConfig, sms: int) -> int:
    """Splits of K: as many as keep the grid within config.programs_per_sm programs an SM, each of at least
    config.min_steps_per_split BLOCK_K steps, the last at most one step shorter than the others
    (grid_math.even_splits); 1 where the N tiles alone fill that or outnumber the counters."""
    tiles = cdiv(out_features, config.block_n)
    if tiles > COUNTER_SLOTS:
        return 1
    steps = cdiv(in_features, config.block_k)
    splits = even_splits(steps, config.programs_per_sm * sms // tiles, config.min_steps_per_split)
    return cdiv(steps, cdiv(steps, splits))  # no empty split


def prefetch_steps(weight: torch.Tensor, config: SplitGemmConfig) -> int:
    """PREFETCH_STEPS where each prefetch (one BLOCK_K step of a row, at a multiple of 16 elements from the
    row's start, or ending at its end) is a whole number of 16-byte units inside a 16-byte aligned row of
    at least one step, else 0 (no prefetch)."""
    return PREFETCH_STEPS if row_head_bytes(weight, config.block_k * 2, 1) else 0


def _counters(device: torch.device) -> torch.Tensor:
    """The device's COUNTER_SLOTS split-K counters (int32, zero between calls)."""
    return device_counters("skinny_split_gemm", device, COUNTER_SLOTS)


def skinny_split_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SplitGemmConfig | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> y [M, N] in x's dtype. `config` and
    `splits` (choose_splits' when None) for benchmarks/gpu/skinny_gemm.py."""
    if not supports(x, weight):
        raise ValueError(
            f"skinny_split_gemm takes CUDA float16/bfloat16 x [M <= {MAX_ROWS}, K] and weight [N, K] with "
            f"contiguous rows and K a multiple of 16; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: use torch.nn.functional.linear"
        )
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features or (bias is not None and tuple(bias.shape) != (out_features,)):
        bias_shape = None if bias is None else tuple(bias.shape)
        raise ValueError(
            f"skinny_split_gemm: x {tuple(x.shape)} needs weight [N, {in_features}] and bias [N] or None; "
            f"got weight {tuple(weight.shape)}, bias {bias_shape}: pass matching shapes"
        )
    config = config or DEFAULT_CONFIG
    tiles = cdiv(out_features, config.block_n)
    steps = cdiv(in_features, config.block_k)
    if splits is None:
        splits = choose_splits(out_features, in_features, config, sm_count(x.device))
    elif not 1 <= splits <= steps or (splits > 1 and tiles > COUNTER_SLOTS):
        raise ValueError(
            f"skinny_split_gemm: splits={splits} must be 1 to {steps} (K {in_features} in steps of "
            f"{config.block_k}) and 1 past {COUNTER_SLOTS} tiles of {config.block_n} (got {tiles}): "
            f"pass splits=None for choose_splits' count"
        )
    steps_per_split = cdiv(steps, splits)
    splits = cdiv(steps, steps_per_split)  # no empty split
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    split = splits > 1
    workspace = y  # not read unsplit
    if split:
        workspace = torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device)
    _skinny_split_kernel[(tiles, splits)](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        workspace,
        _counters(x.device) if split else y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        steps_per_split,
        splits,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        BLOCK_M=MAX_ROWS,  # x's rows padded to one tensor-core tile
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages,
        PREFETCH_STEPS=prefetch_steps(weight, config),
        num_warps=config.num_warps,
        **pdl_kwargs(x.device),
    )
    return y
