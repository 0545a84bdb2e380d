"""The attention layer a model holds: shapes the step's q/k/v and hands them to the device's backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.attention import get_attention_backend
from fitserve.layers.attention.metadata import get_forward_context
from fitserve.layers.rotary_embedding import StepRope

if TYPE_CHECKING:
    from fitserve.layers.attention.backend import AttentionBackend, QKNorm


class Attention(nn.Module):
    """q [T, num_heads * head_dim], k/v [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]; q, k
    and v may also come as [T, heads, head_dim].

    Reads the step's metadata and this layer's cache (`kv_caches[layer_idx]`) from the forward context.
    With no metadata (a profiling run before the KV cache exists) the T tokens attend causally as one
    sequence and nothing is stored.

    sliding_window: the model's window, if it has one. The backends attend over the full context, which
    equals windowed attention while every context fits in the window; a longer one is refused here.

    k_scale, v_scale: this layer's float8 KV cache scales (fitserve/layers/attention/backend.py), 1.0
    unless the checkpoint carries them (set while loading); a cache in the model dtype ignores them.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        layer_idx: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}: "
                "grouped-query attention needs whole groups"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: StepRope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """rope: the step's rotary inputs, when q and k are not rotated yet. A backend that can rotates
        them with its cache write (one kernel); otherwise they are rotated here first. qk_norm: the
        (q_norm, k_norm) to apply to each head before the rotation (Qwen3), in that same kernel when the
        backend rotates."""
        num_tokens = q.shape[0]
        q, k, v = self._by_head(q, k, v)
        context = get_forward_context()
        metadata = context.attn_metadata
        backend = get_attention_backend(q.device) if metadata is not None else None
        q, k, rope, qk_norm = self._rotate_unless_fused(backend, q, k, rope, qk_norm)
        if metadata is None:
            out = _causal_attention_no_cache(q, k, v, self.scale)
        else:
            self._check_window(metadata.max_seq_len)
            assert backend is not None
            kv_cache = context.kv_caches[self.layer_idx]
            out = backend.forward(
                q, k, v, kv_cache, metadata, self.scale, self.k_scale, self.v_scale, rope, qk_norm
            )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: StepRope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """forward's first half, for a step run in pieces (worker/piecewise_graphs.py): writes k and v
        into this layer's cache and returns q [T, heads, head_dim] as attend_cached takes it. Reads only
        the metadata's slot_mapping, so a CUDA graph can hold it. Needs a backend with write/attend."""
        q, k, v = self._by_head(q, k, v)
        context = get_forward_context()
        backend = get_attention_backend(q.device)
        q, k, rope, qk_norm = self._rotate_unless_fused(backend, q, k, rope, qk_norm)
        kv_cache = context.kv_caches[self.layer_idx]
        return backend.write(
            q, k, v, kv_cache, context.attn_metadata, self.k_scale, self.v_scale, rope, qk_norm
        )

    def attend_cached(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """forward's second half: q [T, heads, head_dim] (from write_kv) attends over the cache.
        out: [T, heads, head_dim] to write into. Returns [T, heads * head_dim]."""
        context = get_forward_context()
        metadata = context.attn_metadata
        self._check_window(metadata.max_seq_len)
        backend = get_attention_backend(q.device)
        kv_cache = context.kv_caches[self.layer_idx]
        result = backend.attend(q, kv_cache, metadata, self.scale, self.k_scale, self.v_scale, out)
        return result.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _by_head(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] (a reshape to the shape a tensor
        has already still costs a call, hence the checks)."""
        num_tokens = q.shape[0]
        if q.dim() != 3:
            q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        if k.dim() != 3:
            k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if v.dim() != 3:
            v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def _rotate_unless_fused(
        self,
        backend: AttentionBackend | None,
        q: torch.Tensor,
        k: torch.Tensor,
        rope: StepRope | None,
        qk_norm: QKNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor, StepRope | None, QKNorm | None]:
        """Normalises and rotates q and k here unless the backend does it in its cache write; returns
        what is left for the backend to do."""
        if rope is None or not (backend is not None and backend.fuses_rotary(self.head_dim, rope)):
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
                qk_norm = None
            if rope is not None:
                q, k = rope.apply(q, k)
                rope = None
        return q, k, rope, qk_norm

    def _check_window(self, max_seq_len: int) -> None:
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise ValueError(
                f"a context of {max_seq_len} tokens exceeds layer {self.layer_idx}'s sliding "
                f"window of {self.sliding_window}: set max_model_len to {self.sliding_window} or less"
            )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale:.4g}, layer_idx={self.layer_idx}, sliding_window={self.sliding_window}, "
            f"k_scale={self.k_scale:g}, v_scale={self.v_scale:g}"
        )


def _causal_attention_no_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)
