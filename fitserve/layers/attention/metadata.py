"""What an attention layer needs to know about the batch, and the scoped context that carries it.

The model runner builds one `AttentionMetadata` per step and enters `forward_context(...)` around the
model's forward; each `Attention` layer reads it with `get_forward_context()`. Outside the `with`
block there is no context: a stray read is an error, never stale data from an earlier step.

Token layout: the step's new tokens of all sequences are flattened into one dimension T, sequence
after sequence. Sequence i owns rows query_start_loc[i] : query_start_loc[i+1]; those rows are the
LAST query_len tokens of a context of seq_lens[i] tokens (the first seq_lens[i] - query_len are
already in the KV cache: a prefix-cache hit, an earlier prefill chunk, or earlier decode steps).

KV cache layout, per layer: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values). Token t of sequence i lives in block block_tables[i][t // block_size]
at offset t % block_size; its flat slot is block * block_size + offset (slot_mapping).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fitserve.layers.gated_delta_rule import DeltaNetStepSlots


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: flat KV slot of each new token
    query_start_loc: torch.Tensor  # int32 [B+1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [B]: context length of each sequence, new tokens included
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, for the reference backend and for kernels' launch grids (no device sync).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Hybrid models (core/state_slots.py): each sequence's row of the recurrent state pool; None otherwise
    state_slots_cpu: list[int] | None = None
    # Hybrid models: the step's slots on the device, split into decode rows and prompt pieces (built once
    # per step with its inputs, worker/step_inputs.py; the static buffer of a CUDA graph); None otherwise
    state_slots: DeltaNetStepSlots | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None  # None during a profiling run with no KV cache
    kv_caches: list[torch.Tensor]  # one per attention layer, indexed by layer_idx
    # With several KV cache groups (fitserve/kv_groups.py): each layer's metadata (slot_mapping and
    # block_tables of its group's blocks), indexed by the layer whose cache it is; None: attn_metadata.
    layer_metadata: list[AttentionMetadata] | None = None

    def metadata_for(self, cache_layer: int) -> AttentionMetadata | None:
        """The metadata of the layer owning cache `cache_layer` (its group's block tables)."""
        if self.layer_metadata is None:
            return self.attn_metadata
        return self.layer_metadata[cache_layer]


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    attn_metadata: AttentionMetadata | None,
    kv_caches: list[torch.Tensor],
    layer_metadata: list[AttentionMetadata] | None = None,
) -> Iterator[None]:
    """layer_metadata: per layer, when KV cache groups have tables of their own (ForwardContext)."""
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, kv_caches, layer_metadata)
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside forward_context(): the model runner must enter it")
    return _current
