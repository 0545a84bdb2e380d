"""y = x @ W.T (+ bias) for a few rows of x: the decode steps' linear layers, bound by reading W.

At batch 1 to 64, a linear layer's time is the time to stream its weight [N, K] from memory once.
cuBLAS picks tile shapes made for large M; measured on an H100 its kernels reach ~80% of the copy
bandwidth there (docs/performance.md, section "The skinny GEMM kernel"). Here each program owns BLOCK_N output
features and every row of x: it streams its BLOCK_N x K slice of W in BLOCK_K chunks (pipelined over
NUM_STAGES loads) and multiplies on the tensor cores with x padded to BLOCK_M rows. W is read exactly
once; x (at most 16 x K) stays in cache. No split over K, so no second pass and no workspace: the
N / BLOCK_N programs alone must fill the GPU, which holds for the 7B-class and larger weights this is
used for (`worth_it`: N >= 3072 gives >= 96 programs); smaller ones stay on cuBLAS.

At batch 1 it reads most Llama-3.1-8B weights faster than cuBLAS does (benchmarks/gpu/skinny_gemm.py;
figures in docs/performance.md, section "The skinny GEMM kernel"). At 32 and 64 rows the two are within
~3%, so only up to MAX_ROWS rows come here (one BLOCK_M, one compiled variant per bias / no bias). Before
waiting for the previous kernel, each program asks the L2 for the head of its weight rows
(kernels/l2_prefetch.py).

Reference: torch.nn.functional.linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import kernel_capability, shared_memory_per_block, sm_count
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv
from fitserve.kernels.l2_prefetch import prefetch_row_heads, row_head_bytes

# Rows of x this kernel takes (one tensor-core tile of x).
MAX_ROWS = 16
# Smallest weight worth it: enough programs to fill most of the GPU, and enough bytes that streaming
# dominates. One rank's weights at tensor-parallel sizes 2 and 4 set the lower ends (benchmarks/gpu/
# skinny_gemm.py --tp-shapes, benchmarks/results/h200_skinny_tp_shapes.json, batch 1 to 16 on an H200):
# Llama-3.1-8B's qkv at TP 2, 3,072 x 4,096 (96 programs), 9.5 us against cuBLAS's 10.8 (and
# skinny_split_gemm's 10.7); its o_proj at TP 4, 4,096 x 1,024, 4.4 against 5.3. Llama-3.3-70B's qkv at
# TP 4, 2,560 x 8,192 (80 programs), stays on cuBLAS (14.6 against 16.1).
MIN_OUT_FEATURES = 3072
MIN_IN_FEATURES = 1024
# GPUs on which cuBLAS streams wide weights faster than this kernel (more bytes in flight for a faster
# memory): there a weight of more than WIDE_OUT_FEATURES outputs goes to cuBLAS unless its K is at least
# TALL_K_RATIO times that (down projections, where this kernel still wins). H200 (HBM3e), end to end at
# batch 1 (benchmarks/results/h200x2_tp.json, gemm_rule_ab): Llama-3.1-8B 221.8 -> 233.1 tok/s at TP 1 and
# 341.6 -> 360.2 at TP 2, where sending every weight to cuBLAS gave 227.9 and 329.7. Isolated layers
# (h200_skinny_tp_shapes.json): cuBLAS ahead on qkv / gate_up (8B gate_up 60.9 against 63.1 us, the 70B's
# qkv at TP 2 25.3 against 30.0), this kernel on o / down at up to 4,096 outputs (8B down 28.8 against 31.1).
# On an H100 the end-to-end runs chose this kernel for every Llama-3.1-8B weight (docs/performance.md).
CUBLAS_FOR_WIDE_WEIGHTS_ON = ("H200",)
WIDE_OUT_FEATURES = 4096
TALL_K_RATIO = 3
# Bytes at the head of each of a program's weight rows that it asks the L2 to fetch before waiting for
# the previous kernel (programmatic dependent launch only; 0 turns it off). kernels/l2_prefetch.py.
PREFETCH_ROW_BYTES = 2048
# Prefetch instructions per weight row: with BLOCK_N = 32 and 4 warps, one per thread.
PREFETCH_PIECES = 4


@dataclass(frozen=True)
class SkinnyGemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


# The row count changes with the batch: specializing on it (1, a multiple of 16, other) would compile
# three variants at startup (~0.5 s each) for no measurable gain.
@fast_launch
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
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
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = (k + offs_k) < K
        w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + (k + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# The tile that was fastest or within 2% of it for every Llama-3.1-8B weight at 1 to 16 rows.
DEFAULT_CONFIG = SkinnyGemmConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
# Half-width tiles for weights whose DEFAULT_CONFIG programs come to just over one per SM (up to 1.25) where
# its four stages keep one program resident per SM (A100, H100): there a short second wave runs on a few SMs
# while the rest idle. On an H100 at batch 1, N = 5120 (160 programs on 132 SMs: Qwen3.6-27B's down_proj,
# out_proj and o_proj) read 0.74-0.81 of the copy bandwidth with DEFAULT_CONFIG and 0.83-0.90 with these
# (three resident per SM); benchmarks/results/h100_skinny_gemm_qwen36.json. N = 6144 (192 programs) also
# gained alone (0.83 -> 0.90) but made Llama-3.1-8B's batch-1 decode 0.8% slower (its qkv_proj), so stays.
NARROW_CONFIG = SkinnyGemmConfig(block_n=16, block_k=512, num_warps=4, num_stages=3)


def stage_bytes(config: SkinnyGemmConfig) -> int:
    """Shared memory of one cp.async stage: x's [MAX_ROWS, BLOCK_K] and the weight's [BLOCK_N, BLOCK_K]
    (16-bit); a kernel of num_stages keeps num_stages - 1 (sm_86 build of DEFAULT_CONFIG: 144 KB)."""
    return (MAX_ROWS + config.block_n) * config.block_k * 2


def default_config(shared_memory: int) -> SkinnyGemmConfig:
    """DEFAULT_CONFIG with as many stages as a block's `shared_memory` holds (kernels/capability.py),
    4 KB to spare: 4 on an A100 or H100, 2 on a GPU of 99 KB (sm_86, sm_89) or less."""
    stages = DEFAULT_CONFIG.num_stages
    while stages > 2 and (stages - 1) * stage_bytes(DEFAULT_CONFIG) + 4096 > shared_memory:
        stages -= 1
    return (
        DEFAULT_CONFIG if stages == DEFAULT_CONFIG.num_stages else replace(DEFAULT_CONFIG, num_stages=stages)
    )


def choose_config(out_features: int, shared_memory: int, sms: int) -> SkinnyGemmConfig:
    """The tile for a weight of `out_features` rows on a GPU of `sms` SMs whose blocks may use
    `shared_memory` bytes: NARROW_CONFIG where DEFAULT_CONFIG would leave a short second wave (above),
    else default_config's."""
    config = default_config(shared_memory)
    programs = cdiv(out_features, config.block_n)
    if config == DEFAULT_CONFIG and sms < programs and 4 * programs <= 5 * sms:
        return NARROW_CONFIG
    return config


def worth_it(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when skinny_gemm takes this call and beats cuBLAS on it (measured shapes, see above)."""
    out_features, in_features = weight.shape
    if out_features < MIN_OUT_FEATURES or in_features < MIN_IN_FEATURES or not supports(x, weight):
        return False
    return not wide_weight_to_cublas(out_features, in_features, _gpu_name(x.device.index))


def wide_weight_to_cublas(out_features: int, in_features: int, gpu_name: str) -> bool:
    """Whether a weight [out_features, in_features] goes to cuBLAS on the GPU named `gpu_name` because it
    is wide (CUBLAS_FOR_WIDE_WEIGHTS_ON, above)."""
    return (
        any(name in gpu_name for name in CUBLAS_FOR_WIDE_WEIGHTS_ON)
        and out_features > WIDE_OUT_FEATURES
        and in_features < TALL_K_RATIO * out_features
    )


@functools.cache
def _gpu_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when skinny_gemm can take this call (CUDA, 16-bit floats, few rows, contiguous K)."""
    return streams_rows(x, weight, MAX_ROWS) and weight.shape[1] % 16 == 0


def streams_rows(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """What fitserve's decode GEMMs need: CUDA, 1 to max_rows rows of x, one 16-bit float dtype, and
    rows of x and of the weight contiguous along K."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= max_rows
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyGemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> y [M, N] in x's dtype."""
    if not supports(x, weight):
        raise ValueError(
            f"skinny_gemm takes CUDA float16/bfloat16 x [M <= {MAX_ROWS}, K] and weight [N, K] with "
            f"contiguous rows and K a multiple of 16; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: use torch.nn.functional.linear"
        )
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if config is None:
        shared_memory = shared_memory_per_block(kernel_capability(x.device))
        config = choose_config(out_features, shared_memory, sm_count(x.device))
    y = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    grid = (cdiv(out_features, config.block_n),)
    _skinny_gemm_kernel[grid](
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
        BLOCK_M=MAX_ROWS,  # x's rows padded to one tensor-core tile
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages,
        PREFETCH_BYTES=row_head_bytes(weight, PREFETCH_ROW_BYTES, PREFETCH_PIECES),
        PREFETCH_PIECES=PREFETCH_PIECES,
        num_warps=config.num_warps,
        **pdl_kwargs(x.device),
    )
    return y
