"""The KV cache's and the recurrent state's bytes on one rank, which the plan sizes its pools with.

KV bytes per token of a max_model_len request over the layers that own a cache (each KV cache group with
its own geometry, fitserve/kv_groups.py; a draft model's beside them), the same over one pipeline stage's
layers, a hybrid model's recurrent state pool with its prefix-cache snapshot slots, and on the CPU the KV
cache's size by the engine's own rule (fitserve/cpu_kv_cache.py).
"""

from __future__ import annotations

from fitserve.cpu_kv_cache import CpuKvCacheSize, cpu_kv_cache_size
from fitserve.distributed.pipeline import stage_kv_layers, stage_layer_ranges
from fitserve.kv_groups import KvCacheGroup, elements_per_request_token, kv_cache_groups
from fitserve.planner.formats import DTYPE_BYTES, kv_cache_bytes_per_element
from fitserve.planner.memory_inputs import MemoryInputs


def kv_groups(inputs: MemoryInputs) -> tuple[KvCacheGroup, ...]:
    """The KV cache groups the engine allocates (fitserve/kv_groups.py); () for a model whose layers are
    alike (no per-layer geometry): one full group."""
    if not inputs.shape.kv_layers:
        return ()
    return kv_cache_groups(
        inputs.shape.kv_layers,
        inputs.max_model_len,
        inputs.max_num_batched_tokens,
        inputs.block_size,
        inputs.tensor_parallel_size,
    )


def kv_bytes_per_context_token(inputs: MemoryInputs) -> int:
    """K and V of every layer that owns a cache for one token on one rank, windows or not."""
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    return inputs.shape.kv_elements_per_token(inputs.tensor_parallel_size) * element


def kv_bytes_per_token(inputs: MemoryInputs) -> int:
    """K and V of every layer that owns a cache (each with its own geometry) for one token of a
    max_model_len request on one rank; a sliding-window group counts only the blocks its window keeps
    (fitserve/kv_groups.py), so a pool of N tokens holds N / max_model_len full-length requests."""
    groups = kv_groups(inputs)
    if not groups:
        return kv_bytes_per_context_token(inputs) + draft_kv_bytes_per_token(inputs)
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    target = elements_per_request_token(groups, inputs.max_model_len, inputs.block_size) * element
    return target + draft_kv_bytes_per_token(inputs)


def draft_kv_bytes_per_token(inputs: MemoryInputs) -> int:
    """A draft model's keys and values per token (its pool has as many blocks as the target's); 0 without."""
    if inputs.draft is None:
        return 0
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    return inputs.draft.kv_elements_per_token * element


def stage_kv_bytes_per_token(inputs: MemoryInputs, stage: int) -> int:
    """kv_bytes_per_token over the decoder layers pipeline stage `stage` holds."""
    shape = inputs.shape
    start, end = stage_layer_ranges(shape.num_layers, inputs.pipeline_parallel_size)[stage]
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    if not shape.kv_layers:
        heads = shape.kv_heads_per_rank(inputs.tensor_parallel_size)
        return 2 * (end - start) * heads * shape.head_dim * element
    groups = kv_cache_groups(
        stage_kv_layers(shape.kv_layers, start, end),
        inputs.max_model_len,
        inputs.max_num_batched_tokens,
        inputs.block_size,
        inputs.tensor_parallel_size,
    )
    return elements_per_request_token(groups, inputs.max_model_len, inputs.block_size) * element


def recurrent_state_bytes(inputs: MemoryInputs) -> int:
    """A hybrid model's state pool on one rank: max_num_seqs + 1 live slots and the snapshot slots of
    prefix caching (worker/recurrent_state.py, core/state_slots.py), each every DeltaNet layer's conv state
    (model dtype) and recurrent state (float32); 0 for attention-only models."""
    per_seq = state_bytes_per_seq_on_rank(inputs)
    from fitserve.core.state_slots import num_ring_rows

    if not per_seq:
        return 0
    rows = inputs.max_num_seqs + 1 + num_ring_rows(inputs.max_num_seqs, inputs.speculative_tokens)
    return rows * per_seq + state_snapshot_bytes(inputs)


def state_bytes_per_seq_on_rank(inputs: MemoryInputs) -> int:
    """One request's recurrent state on one rank: tensor parallel splits the DeltaNet key and value heads
    evenly (models/qwen3_5_delta_net.py), so each rank's slots hold 1/tensor_parallel_size of the whole."""
    per_seq = inputs.shape.state_bytes_per_seq(DTYPE_BYTES[inputs.dtype])
    return -(-per_seq // inputs.tensor_parallel_size)


def state_snapshot_bytes(inputs: MemoryInputs) -> int:
    """The snapshot slots' share of recurrent_state_bytes (--mamba-cache-mode align: 2 x max_num_seqs,
    at most 16; core/state_slots.py num_snapshot_slots)."""
    from fitserve.core.state_slots import num_snapshot_slots

    per_seq = state_bytes_per_seq_on_rank(inputs)
    return num_snapshot_slots(inputs.mamba_cache_mode, True, inputs.max_num_seqs) * per_seq


def cpu_kv_size(
    inputs: MemoryInputs, available_bytes: int | None, per_token: int | None = None
) -> CpuKvCacheSize:
    """One rank's CPU KV cache for these settings; `available_bytes`: the RAM the weights of every rank
    leave on the host, split between the ranks; `per_token`: the rank's KV bytes per token (default: all
    layers', as without pipeline stages)."""
    return cpu_kv_cache_size(
        inputs.cpu_kv_cache_space_gib,
        max_model_len=inputs.max_model_len,
        max_num_batched_tokens=inputs.max_num_batched_tokens,
        max_num_seqs=inputs.max_num_seqs,
        block_size=inputs.block_size,
        kv_bytes_per_token=kv_bytes_per_token(inputs) if per_token is None else per_token,
        available_bytes=available_bytes,
        ranks=inputs.world_size,
    )
