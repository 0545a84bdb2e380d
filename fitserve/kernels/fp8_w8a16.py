"""W8A16 fp8 GEMM for few rows (decode): y = x @ (fp8 w * scale)^T with the dequantize in the kernel, so a
layer streams its 1-byte weights once per step instead of writing a 16-bit copy first, and quantizes no
activations (layers/quantization/fp8_compute.py uses it up to MAX_ROWS rows, for W8A8 and weight-only
layers alike, on GPUs whose Triton converts float8 e4m3 natively: compute capability 8.9 and up).

Each program computes BLOCK_N output columns for every row: it walks K in BLOCK_K steps (256 with
per-channel scales, 128 with block scales), loads the [BLOCK_N, BLOCK_K] fp8 tile, converts it to the
activation dtype (exact: e4m3 values fit bfloat16 and float16) and accumulates x_tile @ tile^T in float32.
Per-channel scales multiply the accumulator once at the end; 128-column block scales (weight_block_size
[*, 128]) multiply each step's partial product. Reference: x.float() @ fp8_weight.dequantize(w).T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.capability import kernel_capability

MAX_ROWS = 16
BLOCK_N = 32
BLOCK_K = 128  # with block scales: one 128-column scale a step
# per-channel scales: 256 columns a step. H100, 1 row, the four Llama-3.1-8B layers
# (benchmarks/gpu/fp8_w8a16_sweep.py over BLOCK_N 16-64, BLOCK_K 128/256, 4/8 warps, 3-6 stages):
# 109 us at (32, 256, 4 warps, 4 stages), 115 at (32, 128, 4, 4), 135+ with BLOCK_N 64.
PER_CHANNEL_BLOCK_K = 256
WARPS = 4
STAGES = 4


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
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
        )
        partial = tl.dot(x, tl.trans(w.to(x.dtype)))
        if GROUPED:
            scale = tl.load(s_ptr + rn * stride_s + k0 // BLOCK_K, mask=n_ok, other=0.0)
            acc += partial * scale[None, :]
        else:
            acc += partial
    if not GROUPED:
        acc = acc * tl.load(s_ptr + rn * stride_s, mask=n_ok, other=0.0)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_y + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & n_ok[None, :],
    )


def w8a16_layer_ok(device: torch.device, group_k: int, groups: int) -> bool:
    """Whether a layer's weight (on `device`, `groups` scales a row of `group_k` columns) can use the
    kernel: a GPU of compute capability 8.9 or more, per-channel or 128-column scales."""
    capability = kernel_capability(device) if device.type == "cuda" else None  # a forced target counts
    return capability is not None and capability >= (8, 9) and (groups == 1 or group_k == BLOCK_K)


def w8a16_rows_ok(x: torch.Tensor) -> bool:
    """Whether the kernel takes these activations: at most MAX_ROWS rows of bf16 / fp16, contiguous."""
    return x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1


def fp8_w8a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] (bf16 / fp16) @ (weight float8_e4m3fn [N, K] * scale float32 [N, G])^T -> [M, N]
    in x's dtype; G = 1 (per channel) or K / 128 (128-column blocks). `config`: (BLOCK_N, BLOCK_K,
    warps, stages), for benchmarks/gpu/fp8_w8a16_sweep.py; BLOCK_K must be 128 with block scales."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grouped = scale.shape[1] > 1
    default = (BLOCK_N, BLOCK_K if grouped else PER_CHANNEL_BLOCK_K, WARPS, STAGES)
    block_n, block_k, warps, stages = config or default
    if grouped and block_k != BLOCK_K:
        raise ValueError(f"fp8_w8a16_linear: block scales need BLOCK_K {BLOCK_K}, got {block_k}")
    _w8a16_kernel[(triton.cdiv(n, block_n),)](
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
        GROUPED=grouped,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y
