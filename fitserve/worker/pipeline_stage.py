"""One pipeline stage's part of a step (--pipeline-parallel-size; distributed/pipeline.py has the split).

Global rank 0 plans the step and hands the host inputs to every rank, as with tensor parallel alone. Then,
one batch in flight: the first stage embeds the tokens (filling those still in flight from the sampled ids
its ranks share) and runs its layers; each later stage receives (hidden, residual) from the same
tensor-parallel rank of the stage before, runs its layers and sends them on; the last stage computes the
logits of the sampled rows (and of prompt-logprob rows), which its first rank sends to global rank 0. Rank
0 samples as without stages (the requests' seeded generators, grammars and penalty counts live there) and
shares the sampled ids with its own stage's ranks, the only ones that read them.

No CUDA graphs: a stage's forward waits on another process's send, and a captured receive would replay
into a graph whose peer is not replaying with it; steps run eagerly. Nothing overlaps either: while one
stage computes the others wait, so a step takes the sum of the stages' times (micro-batches in flight on
every stage at once, as vLLM schedules them, are what would make pipeline parallel faster than one GPU).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fitserve.config import EngineConfig
from fitserve.distributed.parallel_state import pp, tp
from fitserve.distributed.pipeline import (
    describe_split,
    receive_from_previous_stage,
    receive_logits_on_first,
    send_logits_to_first,
    send_to_next_stage,
    stage_kv_layers,
    this_stage_layers,
)
from fitserve.kv_layers import KvLayerSpec
from fitserve.layers.attention.metadata import forward_context
from fitserve.planner.memory import MemoryPlan, for_pipeline_stage
from fitserve.worker.kv_allocation import stage_kv_bytes_per_token
from fitserve.worker.step_inputs import StepInputs

logger = logging.getLogger("fitserve")


class PipelineStage:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        state = pp()
        self.config = config
        self.device = device
        self.is_first, self.is_last = state.is_first, state.is_last
        self.start, self.end = this_stage_layers(config.model.num_layers)
        self.hidden_size = config.model.hf_config.hidden_size
        self.dtype = config.model.dtype
        self.vocab_size = config.model.vocab_size
        # what the LM head returns (models/decoder_blocks.py): float32 on the CPU, the model dtype on CUDA
        self.logits_dtype = torch.float32 if device.type == "cpu" else config.model.dtype
        if state.global_rank == 0:
            eager = "" if device.type != "cuda" else "; steps run eagerly (no CUDA graphs under stages)"
            logger.info(
                "Pipeline parallel: %d stages of %d rank(s), %s%s",
                state.size,
                state.tensor_parallel_size,
                describe_split(config.model.num_layers, state.size),
                eager,
            )

    @property
    def reads_sampled_ids(self) -> bool:
        """The first stage's ranks fill tokens in flight from the last step's sampled ids; no other does."""
        return self.is_first

    def kv_layers(self, specs: tuple[KvLayerSpec, ...]) -> tuple[KvLayerSpec, ...]:
        return stage_kv_layers(specs, self.start, self.end)

    def resize_plan(self, plan: MemoryPlan) -> MemoryPlan:
        """The plan sized over every layer, re-sized for the KV of this stage's layers."""
        return for_pipeline_stage(plan, stage_kv_bytes_per_token(self.config, self.start, self.end))

    def forward(
        self,
        model: Any,
        inputs: StepInputs,
        kv_caches: list[torch.Tensor],
        last_sampled: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """This stage's part of the step: the final hidden states on the last stage, None on the others
        (which sent theirs on)."""
        input_ids = inputs.input_ids
        intermediate = None
        if self.is_first:
            if inputs.fill is not None:
                rows, indices = inputs.fill
                input_ids[rows] = last_sampled[indices]
        else:
            shape = (input_ids.shape[0], self.hidden_size)
            intermediate = receive_from_previous_stage(2, shape, self.dtype, self.device)
        with forward_context(inputs.metadata, kv_caches, inputs.layer_metadata):
            out = model(input_ids, inputs.positions, intermediate)
        if self.is_last:
            return out
        send_to_next_stage(tuple(tensor.to(self.dtype) for tensor in out))
        return None

    def forward_alone(self, model: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This stage's layers over zeros for what the stage before would send, nothing sent on
        (profiling and kernel warm-up, inside the caller's forward_context). The hidden states."""
        intermediate = None
        if not self.is_first:
            zeros = torch.zeros((input_ids.shape[0], self.hidden_size), dtype=self.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        out = model(input_ids, positions, intermediate)
        return out if self.is_last else out[0]

    def send_logits(self, logits: torch.Tensor | None) -> None:
        """The last stage: its first rank sends the logits to global rank 0 (the other ranks of the stage
        hold None after the LM head's gather). Returns None: this rank samples nothing."""
        if logits is not None and logits.shape[0] > 0 and tp().is_first:
            send_logits_to_first(logits, self.logits_dtype)
        return None

    def receive_logits(self, rows: int) -> torch.Tensor:
        """Global rank 0: the `rows` logits the last stage sends (send_logits), in the same order."""
        if rows == 0:
            return torch.empty((0, self.vocab_size), dtype=self.logits_dtype, device=self.device)
        return receive_logits_on_first(rows, self.vocab_size, self.logits_dtype, self.device)

    def warm_up_logits(self, model: Any, hidden: torch.Tensor) -> torch.Tensor | None:
        """Kernel warm-up: the last stage runs its LM head (sending nothing); global rank 0 gets zero
        logits to warm its sampler on; None elsewhere."""
        if self.is_last:
            model.compute_logits(hidden)
        if pp().global_rank == 0:
            return torch.zeros((1, self.vocab_size), dtype=self.logits_dtype, device=self.device)
        return None
