"""Rotary embedding and the KV cache write in one kernel: q rotates in place, the rotated k and v go
straight into the paged cache. Qwen3's per-head RMSNorm of q and k (before the rotation) can come too.

The attention kernels read every key from the cache, so the rotated k never has to exist outside it:
one program per token loads its cos/sin row once, rotates q's heads in place and stores k's rotated
heads and v's heads at the token's slot (float8 as cache_write.py stores it, e4m3 below compute
capability 8.9 encoded from its bits by kernels/fp8_bits.py). A negative slot
(CUDA-graph padding) writes nothing to the cache. The rotary dims must cover the whole head.

With the q/k norm weights, each head is normalised first, rounded as kernels/norm.py rounds; separate,
those norms were one program per (token, head) of 128 values: 2 launches a layer in decode, and in an
8192-token prefill step of the Qwen3-0.6B shape 7.7 of its 24.6 ms of GPU time (H100).

Heads wider than 128 (Gemma-4's 256 and 512) are split over a second grid axis, at most
HEAD_TILE_ELEMENTS values of a half per program: one program holding all 32 of Gemma-4-31B's 512-wide q
heads would keep 16k float32 values live (spilled registers) on one SM. Heads of 128 or less keep one
program per token. `norm_rotate_q` runs the same kernel on q alone (Gemma-4's KV-shared layers, which
write no cache).

Reference: fitserve.kernels.reference.rms_norm_reference on q and k, then rotary_embedding_reference,
then reshape_and_cache_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.attention_inputs import kv_cache_for_kernels, kv_cache_scales
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.fp8_bits import to_cache
from fitserve.kernels.grid_math import cdiv, next_power_of_2
from fitserve.kernels.kv_format import is_fp8_kv_cache

# Heads wider than this are split over grid axis 1 (see the module docstring)
UNSPLIT_HEAD_DIM = 128
HEAD_TILE_ELEMENTS = 2048  # heads x half-head values per program when split


@triton.jit
def _store_cache_heads(dst, values, inv_scale, mask, FP8_MAX: tl.constexpr):
    if FP8_MAX > 0.0:
        values = tl.minimum(tl.maximum(values.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    tl.store(dst, to_cache(values, dst.dtype.element_ty), mask=mask)


@triton.jit
def _load_heads(
    first, mask, dtype_ptr, norm_ptr, eps, half_cols, half_mask, HALF: tl.constexpr, NORM: tl.constexpr
):
    """A token's heads as two float32 halves [heads, BLOCK_HALF] from `first` (each head's first half).

    With NORM, each head is RMS-normalised over both halves and multiplied by norm_ptr's weight, rounded
    to dtype_ptr's element type after the normalisation and after the weight (kernels/norm.py's order)."""
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        dtype = dtype_ptr.dtype.element_ty
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inverse = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(norm_ptr + half_cols, mask=half_mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + half_cols, mask=half_mask, other=0.0).to(tl.float32)
        x1 = ((x1 * inverse).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        x2 = ((x2 * inverse).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    return x1, x2


@host_launched
@triton.jit
def _rotary_cache_write_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_norm_eps,
    k_norm_eps,
    k_inv_scale,
    v_inv_scale,
    num_q_heads,
    num_kv_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_sin,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: the cache is in the model dtype, stored as is
    QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
    SPLIT_HEADS: tl.constexpr = False,  # program_id(1) picks BLOCK_HQ q heads and BLOCK_HK kv heads
    WRITE_KV: tl.constexpr = True,  # False: q alone (k, v, the cache and slot_mapping are not read)
):
    # the step's inputs and the cos/sin table before the wait (dependent_launch.py): q, k and v after it
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token, cache_modifier=".cg").to(tl.int64)
    slot = -1
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + token, cache_modifier=".cg").to(tl.int64)
    half_cols = tl.arange(0, BLOCK_HALF)
    half_mask = half_cols < HALF
    cos_row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(cos_row + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_row + HALF + half_cols, mask=half_mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    q_heads = tl.arange(0, BLOCK_HQ)
    if SPLIT_HEADS:
        q_heads += tl.program_id(1) * BLOCK_HQ
    q_mask = (q_heads[:, None] < num_q_heads) & half_mask[None, :]
    q_first = q_ptr + token * stride_q_tok + q_heads[:, None] * stride_q_head + half_cols[None, :]
    q1, q2 = _load_heads(q_first, q_mask, q_ptr, q_norm_ptr, q_norm_eps, half_cols, half_mask, HALF, QK_NORM)
    tl.store(q_first, (q1 * cos[None, :] - q2 * sin[None, :]).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_first + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(q_ptr.dtype.element_ty), mask=q_mask)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_HK)
        if SPLIT_HEADS:
            heads += tl.program_id(1) * BLOCK_HK
        mask = (heads[:, None] < num_kv_heads) & half_mask[None, :]
        first = k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + half_cols[None, :]
        k1, k2 = _load_heads(first, mask, k_ptr, k_norm_ptr, k_norm_eps, half_cols, half_mask, HALF, QK_NORM)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
        dst = dst + heads[:, None] * stride_cache_head + half_cols[None, :]
        # rounded to the model dtype first, as the separate rotary kernel stores k before the write
        rotated1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(k_ptr.dtype.element_ty)
        rotated2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(k_ptr.dtype.element_ty)
        _store_cache_heads(dst, rotated1, k_inv_scale, mask, FP8_MAX)
        _store_cache_heads(dst + HALF, rotated2, k_inv_scale, mask, FP8_MAX)
        v_first = v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + half_cols[None, :]
        v1 = tl.load(v_first, mask=mask, other=0.0)
        v2 = tl.load(v_first + HALF, mask=mask, other=0.0)
        _store_cache_heads(dst + stride_cache_kv, v1, v_inv_scale, mask, FP8_MAX)
        _store_cache_heads(dst + stride_cache_kv + HALF, v2, v_inv_scale, mask, FP8_MAX)


def can_fuse(head_dim: int, cos_sin_cache: torch.Tensor) -> bool:
    """True when the rotary dims cover the whole head (the fused kernel writes no pass-through dims).
    A partial rotation of the Gemma-4 kind (the first pairs (i, i + head_dim / 2) rotate, the rest keep
    angle 0) is a whole-head table whose unrotated columns hold cos 1 and sin 0."""
    return cos_sin_cache.shape[1] == head_dim


def _head_blocks(half: int, num_q_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, programs per token) for heads of 2 * half dims (see the module docstring)."""
    block_hq, block_hk = next_power_of_2(num_q_heads), next_power_of_2(num_kv_heads)
    if 2 * half <= UNSPLIT_HEAD_DIM:
        return block_hq, block_hk, 1
    most = max(1, HEAD_TILE_ELEMENTS // next_power_of_2(half))
    block_hq, block_hk = min(block_hq, most), min(block_hk, most)
    return block_hq, block_hk, max(cdiv(num_q_heads, block_hq), cdiv(num_kv_heads, block_hk))


def rotary_cache_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qk_norm: tuple[torch.Tensor, float, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotates q [T, Hq, D] in place and writes rotated k and v [T, Hkv, D] into kv_cache
    [2, num_blocks, block_size, Hkv, D] at slot_mapping (k itself is left as it was). Returns q.

    positions [T] index cos_sin_cache [max_position, D] (cos then sin halves, as rotary.py takes it).
    qk_norm: (q weight [D], q eps, k weight [D], k eps) of a per-head RMSNorm applied to q and k before
    the rotation (Qwen3's q_norm / k_norm); q keeps the normalised, rotated values.
    Reads no host data: CUDA-graph safe."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if q.dim() != 3 or q.shape[0] != num_tokens or q.shape[2] != head_dim or v.shape != k.shape:
        raise ValueError(
            f"rotary_cache_write takes q [T, Hq, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not can_fuse(head_dim, cos_sin_cache):
        raise ValueError(
            f"rotary dims {cos_sin_cache.shape[1]} do not cover head_dim {head_dim}: rotate with "
            "rotary_embedding and write with reshape_and_cache"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match keys {tuple(k.shape)}: expected "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v, kv_cache, cos_sin_cache)):
        raise ValueError("q, k, v, kv_cache and cos_sin_cache need a contiguous last dimension")
    if qk_norm is not None and not (qk_norm[0].shape == qk_norm[2].shape == (head_dim,)):
        raise ValueError(
            f"q/k norm weights {tuple(qk_norm[0].shape)} and {tuple(qk_norm[2].shape)} must both be "
            f"[head_dim] = [{head_dim}]: the norm runs over each head"
        )
    q_norm_weight, q_norm_eps, k_norm_weight, k_norm_eps = qk_norm or (q, 0.0, q, 0.0)
    if num_tokens == 0:
        return q
    k_scale, v_scale = kv_cache_scales(kv_cache, k_scale, v_scale)
    half = head_dim // 2
    block_hq, block_hk, head_programs = _head_blocks(half, q.shape[1], num_kv_heads)
    grid = (num_tokens,) if head_programs == 1 else (num_tokens, head_programs)
    _rotary_cache_write_kernel[grid](
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        kv_cache_for_kernels(kv_cache),
        slot_mapping,
        q_norm_weight,
        k_norm_weight,
        q_norm_eps,
        k_norm_eps,
        1.0 / k_scale,
        1.0 / v_scale,
        q.shape[1],
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_SIZE=kv_cache.shape[2],
        FP8_MAX=float(torch.finfo(kv_cache.dtype).max) if is_fp8_kv_cache(kv_cache.dtype) else 0.0,
        QK_NORM=qk_norm is not None,
        num_warps=4,
        **pdl_kwargs(q.device),
        **({} if head_programs == 1 else {"SPLIT_HEADS": True}),
    )
    return q


def norm_rotate_q(
    positions: torch.Tensor,
    q: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotates q [T, Hq, D] in place (a strided view is fine), each head RMS-normalised first with
    q_norm's (weight [D], eps) when given, as rotary_cache_write does q; writes no cache (a layer that
    reads another layer's keys and values). Returns q. Reads no host data: CUDA-graph safe."""
    if q.dim() != 3 or q.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            f"norm_rotate_q takes q [T, Hq, D] and a cos_sin_cache with contiguous last dims; got q "
            f"{tuple(q.shape)} (strides {q.stride()})"
        )
    num_tokens, num_heads, head_dim = q.shape
    if not can_fuse(head_dim, cos_sin_cache):
        raise ValueError(
            f"rotary dims {cos_sin_cache.shape[1]} do not cover head_dim {head_dim}: build the cos/sin "
            "table over the whole head (cos 1, sin 0 on the dims that do not rotate)"
        )
    if q_norm is not None and q_norm[0].shape != (head_dim,):
        raise ValueError(f"q norm weight {tuple(q_norm[0].shape)} must be [head_dim] = [{head_dim}]")
    if num_tokens == 0:
        return q
    half = head_dim // 2
    block_hq, _, head_programs = _head_blocks(half, num_heads, 1)
    norm_weight, norm_eps = q_norm or (q, 0.0)
    grid = (num_tokens,) if head_programs == 1 else (num_tokens, head_programs)
    _rotary_cache_write_kernel[grid](
        positions,
        q,
        q,
        q,
        cos_sin_cache,
        q,
        positions,
        norm_weight,
        norm_weight,
        norm_eps,
        norm_eps,
        1.0,
        1.0,
        num_heads,
        0,
        q.stride(0),
        q.stride(1),
        0,
        0,
        0,
        0,
        cos_sin_cache.stride(0),
        0,
        0,
        0,
        0,
        HALF=half,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_HQ=block_hq,
        BLOCK_HK=1,
        BLOCK_SIZE=1,
        FP8_MAX=0.0,
        QK_NORM=q_norm is not None,
        num_warps=4,
        **pdl_kwargs(q.device),
        SPLIT_HEADS=head_programs > 1,
        WRITE_KV=False,
    )
    return q
