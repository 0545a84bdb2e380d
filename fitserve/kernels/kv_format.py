"""How the paged KV cache stores keys and values: one rule for every attention backend and kernel.

The cache is [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values); a token's flat
slot is block * block_size + offset. A cache in the model dtype stores k and v as they are and ignores
the scales. A float8 cache (--kv-cache-dtype fp8 = e4m3, or e5m2) has one float k_scale and v_scale per
attention layer (1.0 unless the checkpoint carries them): a write stores clamp(x / scale, -max, max) in
the float8 type (max = 448 for e4m3, 57344 for e5m2), a read gives stored * scale.

Plain torch, any device: the CPU attention backend writes through `write_kv_cache`, the Triton kernels
(cache_write.py, rotary_cache_write.py) store the same bytes, and reference.py reads them back. Where
Triton has no e4m3 conversion (compute capability below 8.9) the kernels get an e4m3 cache as uint8 and
encode and decode those same bytes themselves (fp8_bits.py): rounded to nearest even, saturated at +-448.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8_kv_cache(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def kv_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8, for index ops that have no float8 kernels; others as they are."""
    return tensor.view(torch.uint8) if is_fp8_kv_cache(tensor.dtype) else tensor


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the cache stores it: clamp(x / scale) in float8 (x * (1 / scale), as the kernels compute it),
    or x in the cache dtype when the cache is not float8."""
    if not is_fp8_kv_cache(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    scaled = x.float() * (1.0 / scale)
    return scaled.clamp_(-limit, limit).to(cache_dtype)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What the cache holds, in `dtype`: float8 values go through float32 and are multiplied by scale.

    With scale 1.0 the conversion is direct, and exact: every e4m3 and e5m2 value is a bf16, fp16 and
    fp32 value."""
    if not is_fp8_kv_cache(stored.dtype) or scale == 1.0:
        return stored.to(dtype)
    values = stored.to(torch.float32)
    return values.mul_(scale).to(dtype)


def write_kv_cache(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Stores k, v [T, num_kv_heads, head_dim] at their flat slots of kv_cache [2, blocks, block, kv, dim].

    A float8 cache stores clamp(k / k_scale) and clamp(v / v_scale); other caches ignore the scales.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    slots = kv_bytes_view(kv_cache).view(2, -1, num_kv_heads, head_dim)
    slots[0].index_copy_(0, slot_mapping, kv_bytes_view(quantize_kv(k, kv_cache.dtype, k_scale)))
    slots[1].index_copy_(0, slot_mapping, kv_bytes_view(quantize_kv(v, kv_cache.dtype, v_scale)))
