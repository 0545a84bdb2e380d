"""Write a step's new keys and values into the paged KV cache (reshape_and_cache).

A float8 cache stores clamp(x * (1 / scale), -max, max), rounded to nearest even (the convention in
kv_format.py); the reciprocal scales are runtime arguments. Below compute capability 8.9 an e4m3 cache
comes as its bytes (uint8) and the kernel encodes them itself (kernels/fp8_bits.py).

Reference: fitserve.kernels.reference.reshape_and_cache_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.attention_inputs import kv_cache_for_kernels, kv_cache_scales
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.fp8_bits import to_cache
from fitserve.kernels.grid_math import next_power_of_2
from fitserve.kernels.kv_format import is_fp8_kv_cache


@host_launched
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    k_inv_scale,
    v_inv_scale,
    num_kv_heads,
    head_dim,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0.0: the cache is in the model dtype, stored as is
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (CUDA-graph batch padding): nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token64 * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    if FP8_MAX > 0.0:
        key = tl.minimum(tl.maximum(key.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_slot
    dst = dst + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(dst, to_cache(key, cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, to_cache(value, cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key, value [T, num_kv_heads, head_dim] -> kv_cache [2, num_blocks, block_size, H, D] at slot_mapping.

    slot_mapping [>= T] int32/int64 on the device; a negative slot skips its token. Reads no host data,
    so it can be captured in a CUDA graph. k_scale, v_scale (host floats): a float8 cache's scales;
    other caches ignore them.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match keys {tuple(key.shape)}: expected "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache need a contiguous last (head_dim) dimension")
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    k_scale, v_scale = kv_cache_scales(kv_cache, k_scale, v_scale)
    fp8_max = float(torch.finfo(kv_cache.dtype).max) if is_fp8_kv_cache(kv_cache.dtype) else 0.0
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache_for_kernels(kv_cache),
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        num_kv_heads,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        FP8_MAX=fp8_max,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        **pdl_kwargs(key.device),
    )
