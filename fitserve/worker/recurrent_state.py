"""Per-request recurrent state of hybrid models (Qwen3.5's Gated DeltaNet layers), beside the paged KV cache.

Each DeltaNet layer keeps, per running request, a conv state (the last K - 1 inputs of its causal conv1d:
conv_dim x (K - 1) in the model dtype) and a recurrent state (value heads x k_dim x v_dim, float32 as the
checkpoints' `mamba_ssm_dtype` asks). The pool holds `slots` of each, preallocated once: max_num_seqs
running requests at most, plus slot 0, a spare no request gets (a captured decode step's padded rows
carry slot -1 and touch no state). The scheduler side hands out the slots (core/state_slots.py); the state is
not zeroed between owners: a sequence whose first token is at position 0 starts from zeros in the layers.
With prefix caching (--mamba-cache-mode align) the pool has snapshot slots after the live ones: states
kept at block boundaries, which a later request with the same prefix starts from. Under speculative
decoding, k rows per live slot follow (worker/state_rings.py): each request's states after each token of
a verify step, of which the accepted one is kept.

Under tensor parallel each rank's pool holds its own heads' states only (the DeltaNet heads split evenly,
models/qwen3_5_delta_net.py): conv_dim and the value heads are the rank's, so a rank's pool is 1/n of one
rank's pool at tensor_parallel_size 1.

`state_bytes_per_slot` is what the memory planner counts per slot, so that the slots (live and snapshot)
come out of the KV cache's budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from fitserve.core.state_slots import SPARE_STATE_SLOTS, num_ring_rows, num_snapshot_slots, num_state_slots
from fitserve.distributed.parallel_state import tp
from fitserve.kv_layers import is_qwen3_5
from fitserve.models.qwen3_5_config import delta_net_heads_per_rank, linear_layer_indices

logger = logging.getLogger("fitserve")

MiB = 1 << 20
RECURRENT_STATE_DTYPE = torch.float32
SPARE_SLOTS = SPARE_STATE_SLOTS


@dataclass(frozen=True)
class RecurrentStateShape:
    """One DeltaNet layer's state per request."""

    conv_shape: tuple[int, int]  # (conv_dim, K - 1), model dtype
    recurrent_shape: tuple[int, int, int]  # (value heads, k_dim, v_dim), float32

    def bytes(self, conv_element_bytes: int) -> int:
        conv = self.conv_shape[0] * self.conv_shape[1] * conv_element_bytes
        c, k, v = self.recurrent_shape
        return conv + c * k * v * RECURRENT_STATE_DTYPE.itemsize


def recurrent_state_layers(config: Any, tensor_parallel_size: int = 1) -> tuple[RecurrentStateShape, ...]:
    """The state shape, on one rank, of each layer that keeps one (empty for a model without recurrent
    layers)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if not is_qwen3_5(config):
        return ()
    key_heads, value_heads = delta_net_heads_per_rank(config, tensor_parallel_size)
    key_size = key_heads * int(config.linear_key_head_dim)
    v_dim = int(config.linear_value_head_dim)
    conv_dim = 2 * key_size + value_heads * v_dim
    shape = RecurrentStateShape(
        (conv_dim, int(config.linear_conv_kernel_dim) - 1),
        (value_heads, int(config.linear_key_head_dim), v_dim),
    )
    return (shape,) * len(linear_layer_indices(config))


def state_bytes_per_slot(config: Any, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes one request's state takes over all recurrent layers on one rank (0 without any)."""
    return sum(layer.bytes(dtype_bytes) for layer in recurrent_state_layers(config, tensor_parallel_size))


class RecurrentStatePool:
    """The state tensors of every recurrent layer: conv [slots, conv_dim, K - 1] and recurrent
    [slots, value heads, k_dim, v_dim] each."""

    def __init__(
        self, layers: tuple[RecurrentStateShape, ...], slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.slots = slots
        self.conv = [torch.zeros((slots, *layer.conv_shape), dtype=dtype, device=device) for layer in layers]
        self.recurrent = [
            torch.zeros((slots, *layer.recurrent_shape), dtype=RECURRENT_STATE_DTYPE, device=device)
            for layer in layers
        ]

    def copy_slots(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Both states of slots `sources` into slots `targets` in every layer (index tensors on the pool's
        device; the gather copies first, so a slot may be both a source and a target)."""
        for tensor in (*self.conv, *self.recurrent):
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))

    def layer_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.conv, self.recurrent, strict=True))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent))


def allocate_recurrent_state(model: torch.nn.Module, config: Any, device: torch.device) -> int:
    """Gives a hybrid model its state pool (max_num_seqs + 1 live slots, then the snapshot slots of
    prefix caching, then k rows per live slot under speculative decoding), of this rank's heads; returns
    its bytes (0: not hybrid). config: the EngineConfig."""
    attach = getattr(model, "attach_state_pool", None)
    layers = recurrent_state_layers(config.model.hf_config, tp().size)
    if attach is None or not layers:
        return 0
    max_num_seqs = config.scheduler.max_num_seqs
    caching = config.cache.enable_prefix_caching
    snapshots = num_snapshot_slots(config.model.mamba_cache_mode, caching, max_num_seqs)
    speculative = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    rings = num_ring_rows(max_num_seqs, speculative)
    slots = num_state_slots(max_num_seqs) + snapshots + rings
    pool = RecurrentStatePool(layers, slots, config.model.dtype, device)
    attach(pool)
    logger.info(
        "Recurrent state: %d layers x %d slots (max_num_seqs %d + %d spare + %d prefix-cache snapshots "
        "+ %d speculative-decoding rows), %.1f MiB",
        len(layers),
        slots,
        max_num_seqs,
        SPARE_SLOTS,
        snapshots,
        rings,
        pool.nbytes / MiB,
    )
    return pool.nbytes
