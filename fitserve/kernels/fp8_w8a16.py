"""W8A16 fp8 GEMM for few rows (decode): y = x @ (fp8 w * scale)^T with the dequantize in the kernel, so a
layer streams its 1-byte weights once per step instead of writing a 16-bit copy first, and quantizes no
activations (layers/quantization/fp8_compute.py uses it up to MAX_ROWS rows, for W8A8 and weight-only
layers alike, from compute capability 7.5; below 8.9, where Triton has no e4m3, the weight comes as its
bytes and kernels/fp8_bits.py decodes them).

Each program computes BLOCK_N output columns for every row: it walks K in BLOCK_K steps (256 with
per-channel scales, 128 with block scales), loads the [BLOCK_N, BLOCK_K] fp8 tile, converts it to the
activation dtype (exact: e4m3 values fit bfloat16 and float16; into bfloat16 from the weight's bytes in
integer instructions, fp8_bits.stored_values, as Triton's conversion would bound the kernel near 2.8 TB/s
on an H200) and accumulates x_tile @ tile^T in float32.
Per-channel scales multiply the accumulator once at the end; 128-column block scales (weight_block_size
[*, 128]) multiply each step's partial product. Reference: x.float() @ fp8_weight.dequantize(w).T.

Split-K, given the layer's counters (`split_counters`, allocated with its weight): a layer whose grid of
BLOCK_N column tiles leaves SMs idle (N 4,096: 128 programs on an H100's 132 SMs, each walking all of K)
splits K into equal parts until the grid fills about PROGRAMS_PER_SM programs an SM, and sums the parts
as the int4 kernels do (kernels/int4_kernel_parts.py `_finish`: each split stores its float32 partial,
the last to arrive at its tile's counter adds them in split order, deterministic, no second kernel and
no host sync, so CUDA graphs capture it).

No programmatic dependent launch here, unlike the int4 and bf16 decode GEMMs: launched early, a waiting
program holds its 48 KB of pipeline buffers on an SM the kernel before it is still using. With PDL and
an L2 prefetch of each row's first KB the H100's batch-1 decode went from 260.4 to 223.8 tok/s
(benchmarks/results/h100_fp8_pdl_trial.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import FP8_WEIGHTS_MIN_CAPABILITY, kernel_capability, sm_count
from fitserve.kernels.fp8_bits import e4m3_as_stored, stored_values
from fitserve.kernels.grid_math import cdiv, even_splits
from fitserve.kernels.int4_kernel_parts import _finish

MAX_ROWS = 16
BLOCK_N = 32
BLOCK_K = 128  # with block scales: one 128-column scale a step
# per-channel scales: 256 columns a step. H100, 1 row, the four Llama-3.1-8B layers
# (benchmarks/gpu/fp8_w8a16_sweep.py over BLOCK_N 16-64, BLOCK_K 128/256, 4/8 warps, 3-6 stages):
# 109 us at (32, 256, 4 warps, 4 stages), 115 at (32, 128, 4, 4), 135+ with BLOCK_N 64.
PER_CHANNEL_BLOCK_K = 256
WARPS = 4
STAGES = 4
# Split K until the grid has about this many programs an SM (at 4 warps and 4 stages of 16 KB, four are
# resident on an H100), into equal parts of at least MIN_STEPS_PER_SPLIT steps, at most MAX_SPLITS.
PROGRAMS_PER_SM = 4
MIN_STEPS_PER_SPLIT = 2
MAX_SPLITS = 16


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_y,
    part_ptr,
    counter_ptr,
    steps_per_split,
    num_splits,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * steps_per_split * BLOCK_K
    for step in range(0, steps_per_split):  # the last split's steps past K load nothing (masked)
        k0 = first + step * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
        )
        # bytes below 8.9 and beside bfloat16 activations: decoded by fp8_bits (e4m3_as_stored)
        partial = tl.dot(x, tl.trans(stored_values(w, x.dtype)))
        if GROUPED:
            scale = tl.load(s_ptr + rn * stride_s + k0 // BLOCK_K, mask=n_ok & (k0 < K), other=0.0)
            acc += partial * scale[None, :]
        else:
            acc += partial
    if not GROUPED:
        acc = acc * tl.load(s_ptr + rn * stride_s, mask=n_ok, other=0.0)[None, :]
    _finish(
        acc,
        rm,
        rn,
        M,
        N,
        y_ptr,
        stride_y,
        s_ptr,
        part_ptr,
        counter_ptr + pid_n,
        pid_k,
        num_splits,
        False,
        SPLIT,
    )


def w8a16_layer_ok(device: torch.device, group_k: int, groups: int) -> bool:
    """Whether a layer's weight (on `device`, `groups` scales a row of `group_k` columns) can use the
    kernel: a GPU of compute capability FP8_WEIGHTS_MIN_CAPABILITY (7.5) or more (the weight as its
    bytes below 8.9, kernels/fp8_bits.py), per-channel or 128-column scales."""
    capability = kernel_capability(device) if device.type == "cuda" else None  # a forced target counts
    runs = capability is not None and capability >= FP8_WEIGHTS_MIN_CAPABILITY
    return runs and (groups == 1 or group_k == BLOCK_K)


def w8a16_rows_ok(x: torch.Tensor) -> bool:
    """Whether the kernel takes these activations: at most MAX_ROWS rows of bf16 / fp16, contiguous."""
    return x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1


def split_counters(out_features: int, device: torch.device | str) -> torch.Tensor:
    """A layer's split-K counters (int32 zeros, one per column tile of the smallest BLOCK_N, 16): give
    them to every fp8_w8a16_linear call of that layer (calls of one layer must not run concurrently on
    two streams; they share them)."""
    return torch.zeros(cdiv(out_features, 16), dtype=torch.int32, device=device)


def choose_splits(out_features: int, in_features: int, block_n: int, block_k: int, sms: int) -> int:
    """Splits of K for one call: as many as keep the grid within PROGRAMS_PER_SM programs an SM, each
    split at least MIN_STEPS_PER_SPLIT steps of block_k, the last at most one step shorter than the
    others (so that no SM waits on a short tail), at most MAX_SPLITS."""
    most = min(PROGRAMS_PER_SM * sms // cdiv(out_features, block_n), MAX_SPLITS)
    return even_splits(cdiv(in_features, block_k), most, MIN_STEPS_PER_SPLIT)


def fp8_w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    config: tuple[int, ...] | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] (bf16 / fp16) @ (weight float8_e4m3fn [N, K] * scale float32 [N, G])^T -> [M, N]
    in x's dtype; G = 1 (per channel) or K / 128 (128-column blocks). `counters` (`split_counters`):
    split-K by `choose_splits`; without them one split. `config`: (BLOCK_N, BLOCK_K, warps, stages[,
    splits]), for benchmarks/gpu/fp8_w8a16_sweep.py; BLOCK_K must be 128 with block scales."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grouped = scale.shape[1] > 1
    default = (BLOCK_N, BLOCK_K if grouped else PER_CHANNEL_BLOCK_K, WARPS, STAGES)
    block_n, block_k, warps, stages = (config or default)[:4]
    if grouped and block_k != BLOCK_K:
        raise ValueError(f"fp8_w8a16_linear: block scales need BLOCK_K {BLOCK_K}, got {block_k}")
    tiles = cdiv(n, block_n)
    splits = 1
    if counters is not None:
        if counters.numel() < tiles or counters.dtype != torch.int32:
            raise ValueError(
                f"fp8_w8a16_linear: {tiles} column tiles of {block_n} need at least {tiles} int32 counters, "
                f"got {counters.numel()} {counters.dtype}: allocate them with split_counters({n}, device)"
            )
        splits = (
            config[4]
            if config is not None and len(config) > 4
            else choose_splits(n, k, block_n, block_k, sm_count(x.device))
        )
    steps = cdiv(k, block_k)
    steps_per_split = cdiv(steps, splits)
    splits = cdiv(steps, steps_per_split)  # no empty split
    workspace = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    weight = e4m3_as_stored(weight, x.device, x.dtype)
    _w8a16_kernel[(tiles, splits)](
        x,
        weight,
        scale,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        y.stride(0),
        workspace,
        counters if counters is not None else y,
        steps_per_split,
        splits,
        GROUPED=grouped,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT=splits > 1,
        num_warps=warps,
        num_stages=stages,
    )
    return y
