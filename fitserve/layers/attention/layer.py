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

    sliding_window: the layer's window, if it has one: query position p sees keys at positions
    p - sliding_window + 1 .. p (as transformers masks it). It is passed to the backend on every path; a
    backend without `supports_sliding_window` attends over the full context, which equals windowed
    attention only while every context fits in the window, so there a longer one is refused.

    kv_cache_layer: the layer whose cache this one reads (Gemma-4's KV-shared layers); it then computes no
    keys or values, writes nothing and `forward` takes k = v = None. None: its own cache (`layer_idx`).

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
        kv_cache_layer: int | None = None,
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
        self.kv_cache_layer = layer_idx if kv_cache_layer is None else kv_cache_layer
        # A shared layer's keys and values for a forward without a cache ([T, kv_heads, head_dim] each)
        self.shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None
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
        if self.reads_shared_cache:
            return self._forward_shared(q)
        q, k, v = self._by_head(q, k, v)
        context = get_forward_context()
        metadata = context.metadata_for(self.layer_idx)
        backend = get_attention_backend(q.device) if metadata is not None else None
        q, k, rope, qk_norm = self._rotate_unless_fused(backend, q, k, rope, qk_norm)
        if metadata is None:
            out = _causal_attention_no_cache(q, k, v, self.scale, self.sliding_window)
        else:
            assert backend is not None
            kv_cache = context.kv_caches[self.layer_idx]
            if self.sliding_window is not None and _masks_window(backend):
                out = backend.forward(
                    q,
                    k,
                    v,
                    kv_cache,
                    metadata,
                    self.scale,
                    self.k_scale,
                    self.v_scale,
                    rope,
                    qk_norm,
                    window=self.sliding_window,
                )
            else:
                self._check_window(metadata.max_seq_len)
                out = backend.forward(
                    q, k, v, kv_cache, metadata, self.scale, self.k_scale, self.v_scale, rope, qk_norm
                )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    @property
    def reads_shared_cache(self) -> bool:
        return self.kv_cache_layer != self.layer_idx

    def _forward_shared(self, q: torch.Tensor) -> torch.Tensor:
        """A KV-shared layer: q (normalised and rotated) attends over `kv_cache_layer`'s cache, which that
        layer filled earlier in this step. Without metadata (a forward with no cache) that layer's keys
        and values of this forward are read from `shared_kv` (set by the model)."""
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim) if q.dim() != 3 else q
        context = get_forward_context()
        metadata = context.metadata_for(self.kv_cache_layer)
        if metadata is None:
            assert self.shared_kv is not None, "the model sets shared_kv before a cacheless forward"
            (k, v), self.shared_kv = self.shared_kv, None  # read once: not held past this forward
            out = _causal_attention_no_cache(q, k, v, self.scale, self.sliding_window)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        backend = get_attention_backend(q.device)
        if not getattr(backend, "supports_kv_sharing", False):
            raise ValueError(
                f"layer {self.layer_idx} reads layer {self.kv_cache_layer}'s KV cache "
                f"(num_kv_shared_layers), which the {backend.name} attention backend cannot do: "
                "run this model with --device cpu"
            )
        window = self.sliding_window
        if window is not None and not _masks_window(backend):
            self._check_window(metadata.max_seq_len)
            window = None
        out = backend.forward(
            q,
            None,
            None,
            context.kv_caches[self.kv_cache_layer],
            metadata,
            self.scale,
            self.k_scale,
            self.v_scale,
            window=window,
            write=False,
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
            q, k, v, kv_cache, context.metadata_for(self.layer_idx), self.k_scale, self.v_scale, rope, qk_norm
        )

    def attend_cached(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """forward's second half: q [T, heads, head_dim] (from write_kv) attends over the cache.
        out: [T, heads, head_dim] to write into. Returns [T, heads * head_dim]."""
        context = get_forward_context()
        metadata = context.metadata_for(self.layer_idx)
        backend = get_attention_backend(q.device)
        kv_cache = context.kv_caches[self.layer_idx]
        if self.sliding_window is not None and _masks_window(backend):
            result = backend.attend(
                q, kv_cache, metadata, self.scale, self.k_scale, self.v_scale, out, window=self.sliding_window
            )
        else:
            self._check_window(metadata.max_seq_len)
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
        """For a backend without window support: a context longer than the window is refused."""
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise ValueError(
                f"a context of {max_seq_len} tokens exceeds layer {self.layer_idx}'s sliding window of "
                f"{self.sliding_window}, which this attention backend does not mask: set max_model_len "
                f"to {self.sliding_window} or less, or run with --device cpu (its backend masks the window)"
            )

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale:.4g}, layer_idx={self.layer_idx}, sliding_window={self.sliding_window}, "
            f"k_scale={self.k_scale:g}, v_scale={self.v_scale:g}"
        )


def _masks_window(backend: AttentionBackend) -> bool:
    return getattr(backend, "supports_sliding_window", False)


def _causal_attention_no_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    num_tokens = q.shape[0]
    mask = None
    if window is not None and num_tokens > window:
        positions = torch.arange(num_tokens, device=q.device)
        distance = positions[:, None] - positions[None, :]
        mask = (distance >= 0) & (distance < window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
