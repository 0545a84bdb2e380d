"""Asking the L2 cache for weight bytes before a kernel needs them (Hopper's bulk prefetch).

With programmatic dependent launch (kernels/dependent_launch.py) a kernel's programs become resident
while the kernel before it is still running, and wait. A decode step at batch 1 streams every weight
once, and between two weight-streaming GEMMs run small kernels (RMSNorm, rotary + cache write,
attention, SiLU) during which memory sits idle. So before its wait, each skinny GEMM program asks the L2
for the head of its own weight rows (`prefetch_row_heads`): the first loads after the wait find them
there instead of starting the stream from DRAM. Measured on an H100 (benchmarks/gpu/single8b.py,
docs/performance.md): 2 KB per row took single8b from 170.3-171.9 to 173.2-174.3 tok/s.

`cp.async.bulk.prefetch.L2.global [address], bytes` fetches a contiguous range into L2 without
registers or a wait, and is only a hint: it changes no value. Weights are never written during a step,
which is what makes asking for them before the previous kernel has finished safe. Addresses and sizes
must be multiples of 16 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_to_l2(addresses, sizes):
    """One bulk L2 prefetch per element: addresses (int64) and sizes in bytes (int32), same shape."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [addresses, sizes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_row_heads(
    w_ptr, pid, N, K, stride_wn, BLOCK_N: tl.constexpr, ROW_BYTES: tl.constexpr, PIECES: tl.constexpr
):
    """The first ROW_BYTES of each of this program's BLOCK_N rows of a 16-bit weight [N, K], in PIECES
    prefetches per row."""
    piece_elems: tl.constexpr = ROW_BYTES // PIECES // 2
    rows = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    cols = tl.minimum(tl.arange(0, PIECES) * piece_elems, K - piece_elems)
    addresses = (w_ptr + rows[:, None] * stride_wn + cols[None, :]).to(tl.int64)
    prefetch_to_l2(addresses, tl.full([BLOCK_N, PIECES], piece_elems * 2, tl.int32))


def row_head_bytes(weight: torch.Tensor, wanted: int, pieces: int) -> int:
    """`wanted` bytes per row where each of `pieces` prefetches is a whole number of 16-byte units
    inside a 16-byte aligned row, else 0 (no prefetch)."""
    piece = wanted // pieces
    row_bytes = weight.shape[1] * weight.element_size()
    row_stride_bytes = weight.stride(0) * weight.element_size()
    aligned = weight.data_ptr() % 16 == 0 and row_stride_bytes % 16 == 0
    if piece == 0 or piece % 16 or row_bytes < wanted or not aligned:
        return 0
    return wanted
