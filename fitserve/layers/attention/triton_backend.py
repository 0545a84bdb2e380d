"""TritonAttentionBackend: the CUDA implementation of fitserve's AttentionBackend protocol, over the Triton
kernels in fitserve/kernels/ (imported only on CUDA: they import triton)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fitserve.kernels.cache_write import reshape_and_cache
from fitserve.kernels.decode_attention import paged_decode_attention
from fitserve.kernels.prefill_attention import paged_prefill_attention
from fitserve.kernels.rotary_cache_write import can_fuse, rotary_cache_write
from fitserve.layers.attention.metadata import AttentionMetadata
from fitserve.layers.rotary_embedding import StepRope

if TYPE_CHECKING:
    from fitserve.layers.attention.backend import QKNorm


class TritonAttentionBackend:
    """Writes the step's k/v at slot_mapping, then attends over the paged cache.

    Decode-only steps (max_query_len == 1) take the split-K decode kernel, whose launch reads no host
    values (CUDA-graph safe: q.shape[0] is the batch; padded rows carry seq_len 0 and slot -1 and
    get zeros). Every other step takes the varlen prefill kernel, which serves prefill, chunked
    prefill, prefix-cache hits and mixed prefill/decode batches alike. A float8 cache is written and
    read with the layer's k_scale / v_scale (runtime floats, baked into a captured graph: they are
    fixed once the weights are loaded).

    Given the step's rotary inputs (`rope`), it rotates q and k itself, in the same kernel as the cache
    write (rotary_cache_write.py): one launch instead of two per layer; Qwen3's q and k norms (`qk_norm`)
    run in that kernel too, instead of two more.

    A layer with a sliding window passes `window`: both kernels mask the keys older than it and skip the
    blocks wholly behind it (a sliding KV cache group's table holds the null block 0 there). A KV-shared
    layer passes `write=False` and k = v = None: it attends over the cache an earlier layer of the same
    step filled.
    """

    name = "triton"
    supports_sliding_window = True  # forward/attend(window=...) mask and skip the keys older than it
    supports_kv_sharing = True  # forward(write=False) reads another layer's cache, writing nothing

    def fuses_rotary(self, head_dim: int, rope: StepRope) -> bool:
        return rope.cos_sin_cache is not None and can_fuse(head_dim, rope.cos_sin_cache)

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
    ) -> torch.Tensor:
        """window: the layer's sliding window (None: none). write False: k and v are None and nothing
        is written (a KV-shared layer; q comes rotated, so rope and qk_norm are None)."""
        if write:
            assert k is not None and v is not None
            q = self.write(q, k, v, kv_cache, metadata, k_scale, v_scale, rope, qk_norm)
        else:
            assert rope is None and qk_norm is None, "a layer that writes no keys gets q rotated already"
        return self.attend(q, kv_cache, metadata, scale, k_scale, v_scale, window=window)

    def write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: StepRope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """forward's first half: k/v into the cache at slot_mapping (rotated and normalised with rope and
        qk_norm, q too, in place). Returns q as attend takes it. Reads only metadata.slot_mapping and no
        host values: CUDA-graph safe at a fixed T."""
        if rope is not None:
            assert rope.positions is not None and rope.cos_sin_cache is not None
            norms = None
            if qk_norm is not None:
                q_norm, k_norm = qk_norm
                norms = (q_norm.weight, q_norm.eps, k_norm.weight, k_norm.eps)
            rotary_cache_write(
                rope.positions,
                q,
                k,
                v,
                rope.cos_sin_cache,
                kv_cache,
                metadata.slot_mapping,
                k_scale,
                v_scale,
                norms,
            )
        else:
            assert qk_norm is None, "q/k norms are fused only with the rotation"
            reshape_and_cache(k, v, kv_cache, metadata.slot_mapping, k_scale, v_scale)
        return q

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        out: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """forward's second half: q [T, Hq, D] attends over the cache, which holds the step's keys and
        values already. out: where to write [T, Hq, D] (a new tensor when None). window: the layer's
        sliding window (None: none).

        The window is passed on whatever the step's lengths, even when every context fits in it: a CUDA
        graph replays a decode with other seq_lens, and a sliding layer's kernels then compile one variant
        each (the windowed one), at startup (profile run, graph capture) rather than mid-serving."""
        if metadata.max_query_len == 1:
            return paged_decode_attention(
                q,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                out=out,
                k_scale=k_scale,
                v_scale=v_scale,
                window=window,
            )
        return paged_prefill_attention(
            q,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            scale,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
            window=window,
        )
