"""The attention backend interface: the CPU backend (cpu_backend.py) and the CUDA one (triton_backend.py)
plug in behind it.

How the KV cache stores keys and values (its layout, and a float8 cache's k_scale / v_scale) is one rule
that every backend and kernel shares: fitserve/kernels/kv_format.py.
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


class AttentionBackend(Protocol):
    """Writes the step's new keys/values into the paged KV cache, then attends.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (T = the step's new tokens);
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    Query row j of sequence i sits at position seq_lens[i] - query_len_i + j and attends causally to
    every cached and new token at or before it. k_scale, v_scale: the layer's float8 cache scales
    (kernels/kv_format.py); host floats, fixed once the weights are loaded. rope: the step's
    rotary inputs, given only when `fuses_rotary` said yes: q and k arrive unrotated and the backend
    rotates them (q in place, k as it is written to the cache). qk_norm: the layer's (q_norm, k_norm),
    given only with rope: q and k arrive unnormalised too, and the backend normalises each head first.

    A backend with `supports_sliding_window` takes `window` (the layer's sliding window: query position p
    sees keys p - window + 1 .. p); one with `supports_kv_sharing` takes `write=False` with k = v = None
    (a KV-shared layer reads the cache another layer filled, writing nothing), and then `window` too
    (None unless it supports windows). A backend without either need not accept them: the layer refuses
    what they would be needed for.
    """

    name: str

    def fuses_rotary(self, head_dim: int, rope: StepRope) -> bool: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: StepRope | None = None,
        qk_norm: QKNorm | None = None,
        window: int | None = None,
        write: bool = True,
    ) -> torch.Tensor: ...
