"""CUDA graphs for decode steps: one captured forward per batch size, replayed with copied inputs.

A decode step of B sequences runs the graph captured for the smallest capture size >= B. Rows past B
are padding: their new key/value goes to slot 0 (the null block, never handed to a request), their
context is one token, and their outputs are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from unittest import mock

import torch

from fitserve.layers.attention.metadata import AttentionMetadata, forward_context

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
    ) -> None:
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[self.max_model_len] * batch,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        with forward_context(self._metadata(batch), self.kv_caches):
            return self.model(self.input_ids[:batch], self.positions[:batch])

    @torch.inference_mode()
    def capture(self) -> tuple[float, int]:
        """Captures every size, largest first so smaller graphs reuse the pool. Returns (secs, bytes)."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        for batch in reversed(self.capture_sizes):
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
    ) -> torch.Tensor:
        """Copies the step's inputs in and replays the graph of its padded size. input_ids holds -1
        where a token is still in flight; fill = (rows, indices into last_sampled, last_sampled) writes
        those in."""
        batch = input_ids.shape[0]
        size = self.padded_size(batch)
        sources = (input_ids, positions, metadata.slot_mapping, metadata.seq_lens, metadata.block_tables)
        self.copy_inputs(sources, size, fill)
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
