"""CUDA graphs for decode steps: one captured forward per batch size, replayed with copied inputs.

A decode step of B sequences runs the graph captured for the smallest capture size >= B. Rows past B
are padding: their new key/value goes to slot 0 (the null block, never handed to a request), their
context is one token, and their outputs are dropped.

A model with several KV cache groups (fitserve/kv_groups.py: Gemma-4's sliding-window layers) gives each
group 1.. its own static slot mapping and block tables, filled beside group 0's each step; every layer's
captured metadata reads its group's buffers (`layer_group`), as the eager forward's layer_metadata does.

A hybrid model (`has_recurrent_state`: Qwen3.5's Gated DeltaNet layers) reads each row's state slot from a
static slots buffer, filled beside the other inputs; padded rows get slot -1, which the DeltaNet kernels
skip (no state read or written). Its prefix-cache snapshot copies run outside the graph (ModelRunner).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from unittest import mock

import torch

from fitserve.distributed.collectives import graph_forwards
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from fitserve.layers.gated_delta_rule import DeltaNetStepSlots

logger = logging.getLogger("fitserve")


@contextlib.contextmanager
def keep_allocator_cache(first: bool) -> Iterator[None]:
    """Inside: torch.cuda.empty_cache does nothing, unless this is the first capture."""
    if first:
        yield
        return
    with mock.patch.object(torch.cuda, "empty_cache", lambda: None):
        yield


def smallest_size_holding(sizes: list[int], count: int, what: str) -> int:
    """The first of the ascending captured `sizes` that is >= count (the graph a step replays)."""
    for size in sizes:
        if size >= count:
            return size
    raise ValueError(f"{what} exceeds the largest captured size {sizes[-1]}")


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        capture_sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_group: list[int] | None = None,
    ) -> None:
        """layer_group: each layer's KV cache group, when the model has more than one (None: one)."""
        self.model = model
        self.kv_caches = kv_caches
        self.capture_sizes = sorted(capture_sizes)
        self.max_batch = self.capture_sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.layer_group = layer_group if layer_group and max(layer_group) > 0 else None
        num_extra = max(layer_group) if self.layer_group is not None else 0
        # groups 1..: (slot_mapping, block_tables), and scratch for the columns their staging also writes
        self.group_buffers = [
            (
                torch.zeros(n, dtype=torch.int64, device=device),
                torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device),
            )
            for _ in range(num_extra)
        ]
        self._group_scratch = (
            torch.zeros(n, dtype=torch.long, device=device),
            torch.zeros(n, dtype=torch.long, device=device),
            torch.ones(n, dtype=torch.int32, device=device),
        )
        # hybrid models: each row's recurrent state slot (-1: a padded row, or the capture's warm-up)
        self.state_slots: torch.Tensor | None = None
        if getattr(model, "has_recurrent_state", False):
            self.state_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        state_slots = None
        if self.state_slots is not None:
            state_slots = DeltaNetStepSlots.decode_only(self.state_slots[:batch])
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[self.max_model_len] * batch,
            state_slots=state_slots,
        )

    def _layer_metadata(self, metadata: AttentionMetadata, batch: int) -> list[AttentionMetadata] | None:
        """Each layer's metadata over its group's static buffers (None with one group)."""
        if self.layer_group is None:
            return None
        groups = [metadata] + [
            dataclasses.replace(metadata, slot_mapping=slots[:batch], block_tables=tables[:batch])
            for slots, tables in self.group_buffers
        ]
        return [groups[group] for group in self.layer_group]

    def _forward(self, batch: int) -> torch.Tensor:
        metadata = self._metadata(batch)
        with forward_context(metadata, self.kv_caches, self._layer_metadata(metadata, batch)):
            return self.model(self.input_ids[:batch], self.positions[:batch])

    @torch.inference_mode()
    def capture(self) -> tuple[float, int]:
        """Captures every size, largest first so smaller graphs reuse the pool. Returns (secs, bytes)."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        for batch in reversed(self.capture_sizes):
            # tensor parallel: the custom all-reduce's kernels in these forwards (graph_forwards)
            with graph_forwards():
                self._forward(batch)  # warm-up: Triton compiles and autotunes outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # torch.cuda.graph empties the allocator's cache before every capture: the first time frees
                # what profiling left, later times only hand the warm-up's blocks back to the driver, to be
                # allocated again right after.
                with keep_allocator_cache(first=self.pool is None), torch.cuda.graph(graph, pool=self.pool):
                    out = self._forward(batch)
                    self.hidden[:batch].copy_(out)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        used = free_before - torch.cuda.mem_get_info()[0]
        return elapsed, used

    def can_run(self, batch: int, max_query_len: int) -> bool:
        return max_query_len == 1 and batch <= self.max_batch

    def padded_size(self, batch: int) -> int:
        return smallest_size_holding(self.capture_sizes, batch, f"batch {batch}")

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        layer_metadata: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor:
        """Copies the step's inputs in and replays the graph of its padded size. input_ids holds -1
        where a token is still in flight; fill = (rows, indices into last_sampled, last_sampled) writes
        those in. layer_metadata: each layer's (the step's, with several KV cache groups)."""
        batch = input_ids.shape[0]
        size = self.padded_size(batch)
        sources = (input_ids, positions, metadata.slot_mapping, metadata.seq_lens, metadata.block_tables)
        self.copy_inputs(sources, size, fill)
        if self.group_buffers:
            self._copy_group_inputs(input_ids, positions, metadata.seq_lens, layer_metadata, size)
        if self.state_slots is not None:
            self._copy_state_slots(metadata, batch, size)
        self.graphs[size].replay()
        return self.hidden[:batch]

    def copy_inputs(
        self,
        sources: tuple[torch.Tensor, ...],
        size: int,
        fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """A step's inputs into the static buffers (rows past the batch up to `size` padded), in one
        Triton launch (kernels/graph_inputs.py; CUDA graphs exist only on CUDA, where the attention
        kernels need Triton anyway)."""
        from fitserve.kernels.graph_inputs import stage_decode_inputs

        stage_decode_inputs(sources, self.static_inputs(), size, fill)

    def _copy_group_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        layer_metadata: list[AttentionMetadata] | None,
        size: int,
    ) -> None:
        """Groups 1..'s slot mappings and block tables into their buffers, padded as group 0's (one
        staging launch each; the token ids, positions and lengths it also copies go to scratch)."""
        from fitserve.kernels.graph_inputs import stage_decode_inputs

        if layer_metadata is None or self.layer_group is None:
            raise ValueError("a model with several KV cache groups replays its graphs with layer_metadata")
        for group, (slots, tables) in enumerate(self.group_buffers, start=1):
            metadata = layer_metadata[self.layer_group.index(group)]
            ids, pos, lens = self._group_scratch
            sources = (input_ids, positions, metadata.slot_mapping, seq_lens, metadata.block_tables)
            stage_decode_inputs(sources, (ids, pos, slots, lens, tables), size)

    def _copy_state_slots(self, metadata: AttentionMetadata, batch: int, size: int) -> None:
        """The step's state slots into the static buffer, the padded rows up to `size` set to -1."""
        assert self.state_slots is not None
        step = metadata.state_slots
        if step is None or not step.is_decode_only or step.decode_slots is None:
            raise ValueError(
                "a hybrid model's graph replays a decode-only step with its state slots "
                "(AttentionMetadata.state_slots from worker/step_inputs.py); run other steps eagerly"
            )
        self.state_slots[:batch].copy_(step.decode_slots, non_blocking=True)
        if size > batch:
            self.state_slots[batch:size].fill_(-1)

    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """The buffers the graphs read: token ids, positions, slots, seq_lens, block tables."""
        return (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)

    def copy_inputs_torch(
        self,
        sources: tuple[torch.Tensor, ...],
        size: int,
        fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """What kernels/graph_inputs.stage_decode_inputs does in one launch, as torch copies: its
        reference in the tests."""
        input_ids, positions, slot_mapping, seq_lens, block_tables = sources
        batch, width = block_tables.shape
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        if fill is not None:
            rows, indices, last_sampled = fill
            self.input_ids[rows] = last_sampled[indices]
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        self.block_tables[:batch, :width].copy_(block_tables, non_blocking=True)
        if size > batch:
            self.slot_mapping[batch:size].zero_()
            self.seq_lens[batch:size].fill_(1)
            self.block_tables[batch:size].zero_()
