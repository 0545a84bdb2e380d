"""Neox-style rotary embedding applied to q and k in place, one program per token.

cos_sin_cache [max_position, rotary_dim] holds cos in its first rotary_dim/2 columns and sin in the
rest (fitserve.kernels.reference.rotary_cos_sin_cache builds one); the first rotary_dim dims of
each head rotate, the rest pass through. Reference: fitserve.kernels.reference.rotary_embedding_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import next_power_of_2


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_head,
    num_heads,
    cos,
    sin,
    half_cols,
    half_mask,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & half_mask[None, :]
    first = base_ptr + heads[:, None] * stride_head + half_cols[None, :]
    second = first + HALF
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(second, (x2 * cos[None, :] + x1 * sin[None, :]).to(base_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_kv_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos_sin,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half_cols = tl.arange(0, BLOCK_HALF)
    half_mask = half_cols < HALF
    cos_row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(cos_row + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_row + HALF + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_q_tok,
        stride_q_head,
        num_q_heads,
        cos,
        sin,
        half_cols,
        half_mask,
        HALF,
        BLOCK_HQ,
    )
    _rotate_heads(
        k_ptr + token * stride_k_tok,
        stride_k_head,
        num_kv_heads,
        cos,
        sin,
        half_cols,
        half_mask,
        HALF,
        BLOCK_HK,
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (strided views of a packed qkv are fine).

    positions [T] int32/int64 index cos_sin_cache rows; returns (q, k).
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rotary_embedding takes q [T, Hq, D] and k [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or rotary_dim > q.shape[2]:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and at most head_dim={q.shape[2]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dimension")
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.shape[1],
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]),
        num_warps=4,
        **pdl_kwargs(q.device),
    )
    return q, k
