"""Qwen3.5/3.6's full-attention q and k before the cache: each head RMS-normed with (1 + weight), then
rotate-half RoPE on its first rotary_dim dims, the rest passed through; q and k in one launch.

The torch path (models/qwen3_5_layers.py, Qwen3_5Attention.forward: Qwen3_5RMSNorm per head, then
PartialRope.rotate, then .contiguous()) takes ~30 launches a layer; this one reproduces its numbers
exactly, rounding to the model dtype where each of its ops rounds. Per head x (float32):
    n = round(x * (mean(x^2) + eps)^-0.5 * (1 + weight))     in float32, rounded once (Qwen3_5RMSNorm)
    with h = R / 2, on dims d < R:
    rot[d] = round(round(n[d] * cos[d]) + round(turned[d] * sin[d])),
        turned[d] = -n[d + h] for d < h, n[d - h] for h <= d < R (torch.cat((-second, first)))
    dims R..D: n
(round: to the model dtype, the identity in float32; cos and sin in the model dtype, as PartialRope
keeps them). The mean is a sum over head_dim divided by it, an IEEE-rounded division as torch's (Triton's
`/` is an approximate one on CUDA) that keeps `mean + eps` from fusing into one FMA. The sum of squares adds
in another order than torch's, so a row's float32 mean can be an ulp apart and, rarely, a value round the
other way.

Each program normalises its heads' rows as a whole [heads, head_dim] tile; a rotated dim's partner
(d + h or d - h) is loaded a second time (from L1) and normalised by the same row factor, so the tile
needs no shuffle. Grid: (tokens, q head blocks + k head blocks), BLOCK_HQ q heads or BLOCK_HK k heads a
program (grid_math.heads_per_program: a tile of ~1024 values): at head_dim 256, 16 q heads and 2 k heads,
a batch-1 step is 5 programs. On an H200 (bf16, 16 q and 2 k heads of 256, 64 rotated): batch 1 in a CUDA
graph 1.2 us against the torch path's 22.2; 8192 tokens 67 us against 469. Against torch's CUDA path: at
8192 tokens 108 of 38M values one bf16 ulp apart (908 in fp16), the sum of squares' order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import cdiv, heads_per_program, next_power_of_2

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_TILE = 1024  # values a program holds: as many whole heads as fit (grid_math.heads_per_program)


@triton.jit
def _norm_rope_heads(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    token,
    head_block,
    num_heads,
    stride_x_token,
    stride_x_head,
    stride_cos,
    stride_sin,
    eps,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Heads [head_block * BLOCK_H, + BLOCK_H) of one token of x: normed, rotated, stored to out (a
    contiguous [T, num_heads, HEAD_DIM])."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < HEAD_DIM
    rotated = cols < ROTARY_DIM
    first_half = cols < HALF
    partner = tl.where(first_half, cols + HALF, cols - HALF)
    # the norm weight and this step's cos/sin (written before the forward's first kernel) before the
    # wait (kernels/dependent_launch.py); the heads after it
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    partner_weight = tl.load(weight_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + cols, mask=rotated, other=0.0, cache_modifier=".cg")
    sin = tl.load(sin_ptr + token * stride_sin + cols, mask=rotated, other=0.0, cache_modifier=".cg")
    wait_for_previous_kernel(USE_PDL)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = (heads < num_heads)[:, None]
    row = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
    x = tl.load(row + cols[None, :], mask=head_mask & col_mask[None, :], other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=head_mask & rotated[None, :], other=0.0).to(tl.float32)
    inverse = tl.rsqrt(tl.div_rn(tl.sum(x * x, axis=1), HEAD_DIM * 1.0) + eps)[:, None]
    dtype = out_ptr.dtype.element_ty
    # (x * inverse) * (1 + weight): Qwen3_5RMSNorm's two float32 products, in its order, rounded once
    normed = ((x * inverse) * (1.0 + weight[None, :])).to(dtype)
    normed_partner = ((x_partner * inverse) * (1.0 + partner_weight[None, :])).to(dtype).to(tl.float32)
    by_cos = (normed.to(tl.float32) * cos.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    by_sin = (normed_partner * sin.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    # round(-a * s) == -round(a * s), and by_cos + -by_sin == by_cos - by_sin: torch's rounded sum
    turned = tl.where(first_half[None, :], by_cos - by_sin, by_cos + by_sin).to(dtype)
    out = tl.where(rotated[None, :], turned, normed)
    dst = out_ptr + token * (num_heads * HEAD_DIM) + heads[:, None] * HEAD_DIM + cols[None, :]
    tl.store(dst, out, mask=head_mask & col_mask[None, :])


@host_launched
@triton.jit
def _qk_norm_partial_rope_kernel(
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    num_q_heads,
    num_k_heads,
    q_head_blocks,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos,
    stride_sin,
    eps,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if block < q_head_blocks:
        _norm_rope_heads(
            q_ptr,
            q_weight_ptr,
            cos_ptr,
            sin_ptr,
            q_out_ptr,
            token,
            block,
            num_q_heads,
            stride_q_token,
            stride_q_head,
            stride_cos,
            stride_sin,
            eps,
            HEAD_DIM,
            ROTARY_DIM,
            BLOCK_HQ,
            BLOCK_D,
            USE_PDL,
        )
    else:
        _norm_rope_heads(
            k_ptr,
            k_weight_ptr,
            cos_ptr,
            sin_ptr,
            k_out_ptr,
            token,
            block - q_head_blocks,
            num_k_heads,
            stride_k_token,
            stride_k_head,
            stride_cos,
            stride_sin,
            eps,
            HEAD_DIM,
            ROTARY_DIM,
            BLOCK_HK,
            BLOCK_D,
            USE_PDL,
        )


def _num_warps(tile: int) -> int:
    return 4 if tile <= 1024 else 8 if tile <= 4096 else 16


def qk_norm_partial_rope(
    query_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3_5Attention's `rope.rotate(q_norm(query))` and `rope.rotate(k_norm(k))`, as new contiguous
    q [T, H, D] and k [T, Hk, D] in the activation dtype (float16, bfloat16 or float32).

    query_gate [T, H, 2D]: q_proj's output viewed per head (each head's query, then its gate; only the
    query is read); k [T, Hk, D]: k_proj's output viewed; both with a contiguous last dim, one dtype.
    q_weight, k_weight [D]: the norms' stored weights (the norm multiplies by 1 + weight, in float32).
    cos, sin [T, R] in the activation dtype, last dim contiguous: PartialRope's tables squeezed (the angles
    duplicated, cat(angles, angles)); R even, at most D. eps: both norms' (config.rms_norm_eps).
    cos and sin are read before the PDL wait, as the step's inputs are (kernels/dependent_launch.py): they
    must come from at least two kernels back, as PartialRope's, built once a step before the first layer,
    do. Reads no host data: CUDA-graph safe."""
    dtype = query_gate.dtype
    if query_gate.dim() != 3 or k.dim() != 3 or query_gate.shape[2] != 2 * k.shape[2]:
        raise ValueError(
            f"qk_norm_partial_rope takes query_gate [T, H, 2 * D] and k [T, Hk, D]; got query_gate "
            f"{tuple(query_gate.shape)} and k {tuple(k.shape)}"
        )
    num_tokens, num_q_heads, _ = query_gate.shape
    _, num_k_heads, head_dim = k.shape
    if k.shape[0] != num_tokens or query_gate.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            f"qk_norm_partial_rope needs query_gate and k of one token count with a contiguous last dim; got "
            f"query_gate {tuple(query_gate.shape)} (strides {query_gate.stride()}), k {tuple(k.shape)} "
            f"(strides {k.stride()})"
        )
    if dtype not in ACTIVATION_DTYPES or k.dtype != dtype:
        raise ValueError(
            f"qk_norm_partial_rope needs query_gate and k in one of float16, bfloat16, float32; got "
            f"query_gate {dtype}, k {k.dtype}"
        )
    weights = (q_weight, k_weight)
    if any(w.shape != (head_dim,) or w.dtype not in ACTIVATION_DTYPES for w in weights):
        raise ValueError(
            f"qk_norm_partial_rope needs q_weight and k_weight [D] = [{head_dim}] in a float dtype; got "
            f"{[(tuple(w.shape), w.dtype) for w in weights]}"
        )
    rotary_dim = cos.shape[-1] if cos.dim() == 2 else -1
    if (
        cos.dim() != 2
        or sin.shape != cos.shape
        or cos.shape[0] != num_tokens
        or rotary_dim % 2
        or rotary_dim > head_dim
    ):
        raise ValueError(
            f"qk_norm_partial_rope needs cos and sin [T, R] = [{num_tokens}, R] with R even and at most "
            f"head_dim {head_dim}; got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if cos.dtype != dtype or sin.dtype != dtype or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(
            f"qk_norm_partial_rope needs cos and sin in {dtype} (query_gate's dtype, as PartialRope keeps "
            f"them) with a contiguous last dim; got cos {cos.dtype} (strides {cos.stride()}), sin "
            f"{sin.dtype} (strides {sin.stride()})"
        )
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=dtype, device=k.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=dtype, device=k.device)
    if num_tokens == 0 or head_dim == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    block_d = next_power_of_2(head_dim)
    block_hq = heads_per_program(num_q_heads, block_d, HEAD_TILE)
    block_hk = heads_per_program(num_k_heads, block_d, HEAD_TILE)
    q_head_blocks = cdiv(num_q_heads, block_hq)
    grid = (num_tokens, q_head_blocks + cdiv(num_k_heads, block_hk))
    _qk_norm_partial_rope_kernel[grid](
        query_gate,
        k,
        q_weight,
        k_weight,
        cos,
        sin,
        q_out,
        k_out,
        num_q_heads,
        num_k_heads,
        q_head_blocks,
        query_gate.stride(0),
        query_gate.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        eps,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_D=block_d,
        num_warps=_num_warps(max(block_hq, block_hk) * block_d),
        **pdl_kwargs(k.device),
    )
    return q_out, k_out
