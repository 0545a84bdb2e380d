"""The attention backend interface: the CPU reference and the CUDA kernels plug in behind it."""

from __future__ import annotations

from typing import Protocol

import torch

from fitserve.layers.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Writes the step's new keys/values into the paged KV cache, then attends.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (T = the step's new tokens);
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    Query row j of sequence i sits at position seq_lens[i] - query_len_i + j and attends causally to
    every cached and new token at or before it.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
