"""Shape, dtype and layout checks, the cache view and the scales that the paged-attention and cache-write
launchers share (plain torch)."""

from __future__ import annotations

import torch

from fitserve.kernels.fp8_bits import e4m3_as_stored
from fitserve.kernels.kv_format import is_fp8_kv_cache


def check_attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected q [T, Hq, D] and kv_cache [2, num_blocks, block_size, Hkv, D], got "
            f"{tuple(q.shape)} and {tuple(kv_cache.shape)}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads, cache_head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}: head_dim must match and "
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if num_q_heads // num_kv_heads > 64:
        raise ValueError(f"{num_q_heads // num_kv_heads} query heads per KV head is above the supported 64")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size} is not supported: use a power of two >= 16")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not (
        kv_cache.dtype == q.dtype or is_fp8_kv_cache(kv_cache.dtype)
    ):
        raise ValueError(
            f"q dtype {q.dtype} and kv_cache dtype {kv_cache.dtype} must match (bf16, fp16, fp32), or the "
            "kv_cache must be float8 (e4m3fn, e5m2)"
        )
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dimension")


def kv_cache_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a kernel applies: the layer's for a float8 cache, 1.0 for a cache in the model dtype.

    Host floats passed as runtime kernel arguments: no recompile per value, no device read."""
    if is_fp8_kv_cache(kv_cache.dtype):
        return float(k_scale), float(v_scale)
    return 1.0, 1.0


def kv_cache_for_kernels(kv_cache: torch.Tensor, queries: torch.dtype | None = None) -> torch.Tensor:
    """The cache tensor the kernels take: a float8 e4m3 cache viewed as its bytes (uint8) where Triton has
    no e4m3 conversion (compute capability below 8.9, or the target FITSERVE_KERNEL_TARGET forces), which
    the kernels then encode and decode in integer operations (kernels/fp8_bits.py), and for the reads
    beside bfloat16 `queries` on a GPU (fp8_bits.decodes_bf16_from_bytes: decoded by
    e4m3_bytes_to_bfloat16, off the conversion unit); any other cache as it is. The bytes are the same
    either way."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return kv_cache
    return e4m3_as_stored(kv_cache, kv_cache.device, queries)


def prefill_strides(
    q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The strides both prefill attention kernels take, in their order: q's and out's token and head
    strides, the cache's (keys/values, block, slot, head) strides, the block table's row stride."""
    return (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
    )  # fmt: skip
