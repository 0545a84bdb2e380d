"""The MTP drafter under tensor parallel: every drafter forward runs on every rank in lockstep, as a
target step does (the layer's linears are split like the target's, its embedding is vocab-parallel, the
LM head gathers the logits to the first rank).

The first rank's drafter (spec_decode/mtp.py) plans each forward on the host and sends its host inputs to
the other ranks over the step channel (tp_worker.DRAFT_STEP) before it queues its own forward; then it
broadcasts the rows only it holds: the input ids its recurrent steps read from the drafts before (on the
device), and the hidden rows (the target's output kept on the first rank, or the layer's own output of
the step before). The other ranks (`MtpRankDrafter`) keep no state of their own but their part of the
layer's KV cache: each forward is the first rank's host inputs, the broadcast ids and rows, the layer, and
the LM head's gather for the rows that draft.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fitserve.distributed.collectives import broadcast_from_first
from fitserve.kv_layers import KvLayerSpec
from fitserve.layers.attention.metadata import forward_context
from fitserve.worker.kv_allocation import layer_caches
from fitserve.worker.step_inputs import HostInputs, upload_inputs
from fitserve.worker.transfer import PinnedStagingRing

if TYPE_CHECKING:
    from fitserve.config import EngineConfig

logger = logging.getLogger("fitserve")


@dataclass(frozen=True)
class DraftChannel:
    """How the first rank's drafter reaches the other ranks (set by the tensor-parallel executor):
    `send` hands a drafter forward's host inputs to every other rank; `guard` runs work and raises a failed
    rank's RankFailedError for an error it caused; `sampling_pending` says whether the last target step's
    sampled ids are not broadcast yet (deferred sampling), when no drafter collective may run;
    `after_sampling`: what runs once such a deferred sampling is queued (the drafter's held work)."""

    send: Callable[[HostInputs], None]
    guard: Callable[[Callable[[], Any]], Any]
    sampling_pending: Callable[[], bool]
    after_sampling: list[Callable[[], None]] = field(default_factory=list)


def mtp_rank_kv_spec(hf_config: Any, tensor_parallel_size: int) -> KvLayerSpec:
    """The MTP layer's KV geometry on one rank: its share of the KV heads (one at least: replicated when
    ranks outnumber them), as the target's full-attention layers."""
    heads = max(1, int(hf_config.num_key_value_heads) // tensor_parallel_size)
    return KvLayerSpec(heads, int(hf_config.head_dim), 0)


def exchange_rows(input_ids: torch.Tensor, hidden: torch.Tensor, has_fill: bool) -> torch.Tensor:
    """The first rank's input ids (when some were read on the device) and hidden rows, on every rank: the
    first rank's in place; returns the hidden rows (contiguous)."""
    if has_fill:
        broadcast_from_first(input_ids)
    return broadcast_from_first(hidden.contiguous())


class MtpRankDrafter:
    """The MTP layer on a tensor-parallel rank other than the first: its shard of the layer, its part of
    the layer's KV cache, and each forward the first rank sends."""

    def __init__(self, config: EngineConfig, target: torch.nn.Module) -> None:
        from fitserve.spec_decode.mtp import build_predictor, read_mtp_checkpoint

        self.config = config
        self.device = config.device.torch_device
        self.block_size = config.cache.block_size
        hf_config = target.config
        checkpoint = read_mtp_checkpoint(config, dummy=config.model.load_format == "dummy")
        self.predictor = build_predictor(config, checkpoint, hf_config)
        self.target = target
        self.embed = target.model.embed_tokens
        self.hidden_size = int(hf_config.hidden_size)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.predictor.parameters())
        self.spec = mtp_rank_kv_spec(hf_config, config.parallel.tensor_parallel_size)
        element = config.cache.torch_kv_cache_dtype(config.model.dtype).itemsize
        self.kv_bytes_per_token = 2 * self.spec.num_kv_heads * self.spec.head_dim * element
        self.staging = PinnedStagingRing(self.device)
        self.kv_caches: list[torch.Tensor] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The layer's pool: as many blocks as the target's (the first rank's drafter allocates the same)."""
        dtype = self.config.cache.torch_kv_cache_dtype(self.config.model.dtype)
        self.kv_caches = layer_caches((self.spec,), [0], num_blocks, self.block_size, dtype, self.device)

    @torch.inference_mode()
    def run(self, host: HostInputs) -> None:
        """One drafter forward of the first rank's: the same collectives in the same order (the ids' and
        rows' broadcasts, the embedding's and the layer's all-reduces, the LM head's gather)."""
        inputs = upload_inputs(host, self.staging, [0])
        ids = inputs.input_ids
        empty = torch.empty(ids.shape[0], self.hidden_size, dtype=self.config.model.dtype, device=self.device)
        hidden = exchange_rows(ids, empty, host.has_fill)
        with forward_context(inputs.metadata, self.kv_caches):
            out = self.predictor(self.embed(ids), hidden, inputs.positions)
        if host.num_samples:
            if inputs.sample_rows is not None:
                out = out[inputs.sample_rows]
            self.target.compute_logits(out)  # the gather: the first rank takes the drafts


def rank_drafter(config: EngineConfig, runner: Any) -> MtpRankDrafter | None:
    """The drafter a tensor-parallel rank other than the first runs beside its ModelRunner (method mtp),
    counted in the rank's KV cache sizing as the first rank counts its own; None for other methods."""
    spec = config.speculative
    if spec is None or spec.method != "mtp":
        return None
    drafter = MtpRankDrafter(config, runner.model)
    runner.draft_weight_bytes = drafter.weight_bytes
    runner.draft_kv_bytes_per_token = drafter.kv_bytes_per_token
    return drafter
