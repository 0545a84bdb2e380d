"""The attention backend interface: the CPU reference and the CUDA kernels plug in behind it.

It also fixes how a float8 KV cache (--kv-cache-dtype fp8) stores values, which every backend
shares: each attention layer has one float k_scale and v_scale (1.0 unless the checkpoint carries
them); a write stores clamp(x / scale, -max, max) in the float8 type (max = 448 for e4m3, 57344 for
e5m2), a read gives stored * scale. A cache in the model dtype stores x as is and ignores the scales.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from fitserve.layers.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from fitserve.layers.layernorm import RMSNorm
    from fitserve.layers.rotary_embedding import StepRope

    # Qwen3's per-head RMSNorm of q and of k, applied before the rotation
    QKNorm = tuple[RMSNorm, RMSNorm]

FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


class AttentionBackend(Protocol):
    """Writes the step's new keys/values into the paged KV cache, then attends.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (T = the step's new tokens);
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    Query row j of sequence i sits at position seq_lens[i] - query_len_i + j and attends causally to
    every cached and new token at or before it. k_scale, v_scale: the layer's float8 cache scales
    (see the module docstring); host floats, fixed once the weights are loaded. rope: the step's
    rotary inputs, given only when `fuses_rotary` said yes: q and k arrive unrotated and the backend
    rotates them (q in place, k as it is written to the cache). qk_norm: the layer's (q_norm, k_norm),
    given only with rope: q and k arrive unnormalised too, and the backend normalises each head first.
    """

    name: str

    def fuses_rotary(self, head_dim: int, rope: StepRope) -> bool: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: StepRope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor: ...


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
