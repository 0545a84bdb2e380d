"""`mtp` speculation (vLLM's method `mtp`; `qwen3_next_mtp` and `deepseek_mtp` are read as it): the
checkpoint's own multi-token-prediction layer drafts k tokens per request from the target's output hidden
states. Built for Qwen3.5 / Qwen3.6 (config `mtp_num_hidden_layers` 1, tensors `mtp.*`; the layer:
models/qwen3_5_mtp.py).

The layer's row at position p reads (token p + 1, the target's output hidden state at p, after its final
norm) and predicts token p + 2 through the target's LM head; its output (after `mtp.norm`) is the next
step's hidden, so k drafts reuse the one layer k times (vLLM's recurrence: step i reads the draft of step
i - 1 and the layer's own output). It is run as EAGLE-3's head is (fitserve/spec_decode/eagle3/, whose
drafter this one is): the target copies its output rows into a buffer inside its forward
(Qwen3_5Model.keep_output_hidden: CUDA graphs captured after replay the copy), the engine hands each
step's rows over (`after_launch`), the layer keeps its own paged KV cache (one layer, a pool of as many
blocks as the target's), catches up on the accepted positions from the target's rows (zeros where the
target computed none: a prefix-cache hit), and drafts with k - 1 recurrent steps, one forward for the
whole batch each. Drafts are greedy (point mass): the verify step keeps the target's distribution.

Tensor parallel: the layer is split like the target's layers on every rank, each rank keeps its heads' part
of the layer's KV cache, and every drafter forward runs on every rank in lockstep (worker/draft_steps.py:
this rank plans each forward and sends its host inputs and the rows only it holds). An eager catch-up that
falls while a target step's sampling is deferred waits until that sampling is queued (no collective may
run before the step's sampled ids are broadcast).

Not built: pipeline parallel (refused), checkpoints of more than one MTP layer (refused), CUDA graphs for
the drafter's own steps (they run eagerly: one host sync per draft).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fitserve.core.scheduler import ScheduledRequest
from fitserve.models.qwen3_5_mtp import (
    Qwen3_5MultiTokenPredictor,
    missing_mtp_keys,
    mtp_keys,
    mtp_layer_count,
    runs_mtp,
    stores_quantized,
)
from fitserve.spec_decode.eagle3.drafter import Eagle3Drafter, _HeadSequence, aux_buffer_rows
from fitserve.worker.draft_steps import DraftChannel, exchange_rows, mtp_rank_kv_spec

if TYPE_CHECKING:
    from fitserve.config import EngineConfig

logger = logging.getLogger("fitserve")

GiB = 1 << 30


@dataclass(frozen=True)
class MtpCheckpoint:
    """The target's MTP layers as read before loading: the weight files holding `mtp.*` tensors (none for
    dummy weights), config.json's mtp_num_hidden_layers, and whether the files store the layer quantized
    (None for dummy weights: the format's ignore list decides)."""

    name: str
    files: tuple[Path, ...]
    num_layers: int
    quantized: bool | None = None


def read_mtp_checkpoint(config: EngineConfig, dummy: bool = False) -> MtpCheckpoint:
    """The target's MTP layers, checked before any weight loads: a Qwen3.5 / Qwen3.6 target without
    pipeline stages, config.json's mtp_num_hidden_layers 1, and (real weights) the `mtp.*` tensors in its
    files."""
    from fitserve.models.weights import list_safetensors_files

    pipeline = int(getattr(config.parallel, "pipeline_parallel_size", 1) or 1)
    if pipeline > 1:
        raise ValueError(
            f"--speculative-config method mtp with --pipeline-parallel-size {pipeline} is not built yet: the "
            "MTP layer reads the last stage's output and the first stage's embedding; set "
            "--pipeline-parallel-size 1 (--tensor-parallel-size runs it), or use method ngram"
        )
    mc = config.model
    hf_config = mc.hf_config
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not runs_mtp(hf_config):
        raise ValueError(
            f"--speculative-config method mtp (the checkpoint's own MTP layers) on {mc.model} "
            f"({', '.join(architectures) or 'no architecture'}) is not built: fitserve runs those of "
            "Qwen3.5 / Qwen3.6 checkpoints; use method ngram, draft_model or eagle3 for this model"
        )
    layers = mtp_layer_count(hf_config)
    if layers == 0:
        raise ValueError(
            f"--speculative-config method mtp: {mc.model} has no MTP layers (config.json "
            "mtp_num_hidden_layers is 0 or absent, method mtp needs 1): use a checkpoint that keeps them "
            "(the Qwen3.5 / Qwen3.6 releases have 1), or method ngram or draft_model"
        )
    if layers > 1:
        raise ValueError(
            f"--speculative-config method mtp: {mc.model} has {layers} MTP layers (mtp_num_hidden_layers), "
            "fitserve runs checkpoints of 1: drop --speculative-config, or use method ngram or draft_model"
        )
    if dummy:
        return MtpCheckpoint(mc.model, (), layers)
    holding, keys = mtp_keys(list_safetensors_files(mc.model_path))
    missing = missing_mtp_keys(keys)
    if missing:
        raise ValueError(
            f"--speculative-config method mtp: the weights of {mc.model} have no "
            f"{', '.join(missing)} tensors, though config.json says "
            f"mtp_num_hidden_layers {layers} (quantized exports often drop them): use a checkpoint that "
            "keeps the mtp.* tensors, or drop --speculative-config"
        )
    return MtpCheckpoint(mc.model, holding, layers, stores_quantized(keys))


def _mtp_tensors(files: Iterable[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in list(f.keys()):  # noqa: SIM118 - safe_open is not a mapping
                if key.startswith("mtp."):
                    yield key, f.get_tensor(key)


class _MtpHead:
    """The MTP layer seen through EAGLE-3's head interface (eagle3/drafter.py calls these): no fc over
    the target's rows (the layer's own fc reads them with the embedding), the output is both the logits'
    input and the next step's hidden, the drafts are the target's LM head's argmax."""

    def __init__(self, predictor: Qwen3_5MultiTokenPredictor, target: nn.Module, vocab_size: int) -> None:
        self.predictor = predictor
        self.target = target
        self.vocab_size = vocab_size
        self.fc = nn.Identity()

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.predictor(embeds, hidden, positions)
        return out, out

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(normed)[:, : self.vocab_size].argmax(dim=-1)


def build_predictor(
    config: EngineConfig, checkpoint: MtpCheckpoint, hf_config: Any
) -> Qwen3_5MultiTokenPredictor:
    """The MTP layer on this rank (split like the target's layers under tensor parallel), its weights
    loaded from the checkpoint's `mtp.*` tensors (random for dummy weights), in eval mode."""
    from fitserve.layers.quantization.quant_config import quant_format
    from fitserve.models.loader import default_dtype

    with default_dtype(config.model.dtype), config.device.torch_device:
        # a 16-bit MTP layer (the usual export) stays 16-bit beside a quantized target
        quant = None if checkpoint.quantized is False else quant_format(hf_config)
        predictor = Qwen3_5MultiTokenPredictor(hf_config, quant)
    with torch.no_grad():
        if checkpoint.files:
            loaded = predictor.load_weights(_mtp_tensors(checkpoint.files))
            missing = sorted({name for name, _ in predictor.named_parameters()} - loaded)
            if missing:
                raise ValueError(
                    f"the MTP layer of {checkpoint.name} has no weights for {', '.join(missing[:6])}: "
                    "the checkpoint does not match its config.json; download it again"
                )
        else:
            predictor.initialize_dummy(config.model.seed)
    return predictor.eval()


class MtpDrafter(Eagle3Drafter):
    """EAGLE-3's drafter (bookkeeping, the target's rows, catch-up, recurrence) around the MTP layer.
    `channel`: the other tensor-parallel ranks (worker/draft_steps.py); None on one device."""

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: MtpCheckpoint,
        target: nn.Module,
        channel: DraftChannel | None = None,
    ) -> None:
        from fitserve.worker.block_table_rows import BlockTableRows
        from fitserve.worker.transfer import PinnedStagingRing

        self.config = config
        self.checkpoint = checkpoint  # type: ignore[assignment]
        self.model_config = config.model  # the pool's dtype is the target's
        self.k = config.speculative.num_speculative_tokens
        self.device = config.device.torch_device
        self.block_size = config.cache.block_size
        self.channel = channel
        # eager catch-ups held while a target step's sampling is deferred (tensor parallel only)
        self._hold_eager = False
        self._held: list[tuple[_HeadSequence, int]] = []
        if channel is not None:  # run right after the deferred sampling that held them
            channel.after_sampling.append(self._run_held)
        started = time.perf_counter()
        hf_config = target.config
        predictor = build_predictor(config, checkpoint, hf_config)
        self.predictor = predictor
        self.vocab_size = config.model.vocab_size
        self.head = _MtpHead(predictor, target, self.vocab_size)  # type: ignore[assignment]
        self.embed = target.model.embed_tokens
        # the target keeps its output rows from now on (before its graphs are captured)
        self.aux = target.model.keep_output_hidden(aux_buffer_rows(config))
        self.weight_bytes = sum(t.numel() * t.element_size() for t in predictor.parameters())
        self.weight_bytes += self.aux.numel() * self.aux.element_size()
        spec = mtp_rank_kv_spec(hf_config, config.parallel.tensor_parallel_size)
        element = config.cache.torch_kv_cache_dtype(config.model.dtype).itemsize
        self.kv_bytes_per_token = 2 * spec.num_kv_heads * spec.head_dim * element
        logger.info(
            "MTP layer of %s loaded: %.2f GiB (with the target's hidden-state buffer) in %.1f s, %d draft "
            "tokens per step",
            checkpoint.name,
            self.weight_bytes / GiB,
            time.perf_counter() - started,
            self.k,
        )
        self.specs = (spec,)
        self.layer_group = [0]
        self.staging = PinnedStagingRing(self.device)
        self.table_rows = BlockTableRows(-(-(config.model.max_model_len + self.k) // self.block_size))
        self.kv_manager = None
        self.kv_caches = []
        self.sequences = {}
        self._zeros = None

    # ---- tensor parallel: every forward on every rank ----------------------------------------------
    def propose(self, requests: list, running_ids: set[str]) -> list[list[int]]:
        if self.channel is None:
            return super().propose(requests, running_ids)
        return self.channel.guard(lambda: self._propose_with_held(requests, running_ids))

    @torch.inference_mode()
    def _propose_with_held(self, requests: list, running_ids: set[str]) -> list[list[int]]:
        self._run_held()
        return super().propose(requests, running_ids)

    def after_launch(self, scheduler_output: Any) -> None:
        if self.channel is None:
            super().after_launch(scheduler_output)
            return
        self.channel.guard(lambda: self._after_launch_in_order(scheduler_output))

    @torch.inference_mode()
    def _after_launch_in_order(self, scheduler_output: Any) -> None:
        """after_launch, its eager catch-up held while the step's sampling is deferred (the other ranks
        broadcast the step's sampled ids right after its forward, the first rank only once it samples):
        run once the sampling is queued (channel.after_sampling), or at the next drafter call."""
        self._hold_eager = self.channel.sampling_pending()
        try:
            if not self._hold_eager:
                self._run_held()
            super().after_launch(scheduler_output)
        finally:
            self._hold_eager = False

    def _catch_up(self, targets: list, sample: bool) -> Any:
        if self._hold_eager and not sample:
            self._held.extend(targets)
            return None, None, {}
        return super()._catch_up(targets, sample)

    @torch.inference_mode()
    def _run_held(self) -> None:
        """The held eager catch-ups of sequences still live, each up to the furthest position held."""
        held, self._held = self._held, []
        furthest: dict[int, tuple[_HeadSequence, int]] = {}
        for seq, upto in held:
            if self.sequences.get(seq.request_id) is seq:
                known = furthest.get(id(seq), (seq, -1))[1]
                furthest[id(seq)] = (seq, max(known, upto))
        live = [(seq, upto) for seq, upto in furthest.values() if upto >= seq.num_computed_tokens]
        if live:
            super()._catch_up(live, sample=False)

    def _before_upload(self, host: Any) -> None:
        if self.channel is not None:  # the other ranks get the host inputs first
            self.channel.send(host)

    def _forward_rows(
        self,
        items: list[ScheduledRequest],
        previous: tuple[torch.Tensor, dict[str, int]] | None,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Eagle3Drafter's forward of the layer over `items`, under tensor parallel with the other ranks:
        they get the host inputs first (_before_upload), then the ids read on the device and the hidden
        rows."""
        host, inputs, hidden = self._prepare_rows(items, previous, hidden)
        if self.channel is not None:
            hidden = exchange_rows(inputs.input_ids, hidden, host.has_fill)
        return self._head_rows(inputs, hidden, host.num_samples > 0)
