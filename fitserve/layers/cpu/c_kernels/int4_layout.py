"""The int4 GEMM's weight layout (int4_gemm.c): packing a matrix of 4-bit groups into it, and back.

A [N, K] weight is w[n, k] = code[n, k] * step[n, k // 32] + minimum[n, k // 32], code in 0..15.
- codes  uint8 [N / 16, K / 8, 64]: byte 4 j + i of block b, chunk c holds code[16 b + j, 8 c + i] (low
  nibble) and code[16 b + j, 8 c + 4 + i] (high nibble);
- scales float16 [N / 16, K / 32, 2, 16]: [b, g, 0, j] = step[16 b + j, g], [b, g, 1, j] = minimum[...].
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
BLOCK_COLUMNS = 16


def kernel_shape_ok(out_features: int, in_features: int) -> bool:
    return out_features % BLOCK_COLUMNS == 0 and in_features % GROUP_SIZE == 0


def pack_for_kernel(
    codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int [N, K] (0..15), step and minimum float16 [N, K / 32] -> (codes, scales) as the kernel
    reads them."""
    out_features, in_features = codes.shape
    if not kernel_shape_ok(out_features, in_features):
        raise ValueError(
            f"a {out_features} x {in_features} weight does not fit the int4 GEMM's layout: out features must "
            f"be a multiple of {BLOCK_COLUMNS} and in features of {GROUP_SIZE}"
        )
    blocks, groups = out_features // BLOCK_COLUMNS, in_features // GROUP_SIZE
    # [block, column j, chunk, half, i]: k = 8 chunk + 4 half + i
    split = codes.to(torch.uint8).view(blocks, BLOCK_COLUMNS, in_features // 8, 2, 4)
    packed = (split[..., 0, :] | (split[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()
    scales = torch.stack(
        (step.view(blocks, BLOCK_COLUMNS, groups), minimum.view(blocks, BLOCK_COLUMNS, groups)), dim=2
    )  # [block, column j, 2, group]
    return packed.view(blocks, in_features // 8, 64), scales.permute(0, 3, 2, 1).contiguous()


def unpack_from_kernel(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a packed (codes, scales) pair holds."""
    blocks, chunks, _ = packed.shape
    groups = scales.shape[1]
    halves = torch.stack((packed & 0xF, packed >> 4), dim=2).view(blocks, chunks, 2, BLOCK_COLUMNS, 4)
    codes = halves.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK_COLUMNS, chunks * 8)
    columns = scales.permute(0, 3, 2, 1).reshape(blocks * BLOCK_COLUMNS, 2, groups).float()
    step, minimum = columns[:, 0], columns[:, 1]
    grouped = codes.float().view(-1, groups, GROUP_SIZE) * step[..., None] + minimum[..., None]
    return grouped.view(blocks * BLOCK_COLUMNS, chunks * 8)
