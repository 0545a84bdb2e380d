"""CUDA graphs for steps with prompt tokens (prefill chunks, mixed batches) of up to 1,024 tokens.

A decode step replays one graph of the whole forward (cuda_graphs.py). A step with prompt tokens
cannot: its attention kernel's grid depends on the sequences' query lengths, host values that change
every step. Run eagerly, such a step is ~13 launches a layer from Python; on the 8B shape with 31
streams decoding beside a 225-token chunk the host took ~11 ms for a step the GPU ran in ~12 ms, so
every step with a new prompt in it was as slow as the host (benchmarks/gpu/mixed_step.py).

So those steps run in pieces. The model's `forward_in_pieces` cuts the forward at each layer's
attention core; each piece in between (norms, projections, MLP, rotary and cache write) is a CUDA
graph captured per padded token count, and the cores run eagerly over the step's real rows between
replays: a 32-layer step is 33 replays and 32 attention launches.

Rows past the step's tokens up to the padded size compute garbage nobody reads: their keys and values
go to slot 0 (the null block, never handed to a request) and the attention cores skip them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from typing import Any

import torch

from fitserve.distributed.collectives import graph_forwards
from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from fitserve.worker.cuda_graphs import keep_allocator_cache, smallest_size_holding

logger = logging.getLogger("fitserve")


class PiecewiseGraphRunner:
    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """model: has forward_in_pieces (models/decoder_blocks.py) and attention_layers."""
        self.model = model
        self.attention_layers: list[Attention] = model.attention_layers
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.q = torch.zeros((n, num_heads, head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # per size, the last piece's hidden states
        self.pool = None
        self.steps_run = 0

    def _pieces(self, size: int) -> Generator[Attention, None, torch.Tensor]:
        return self.model.forward_in_pieces(
            self.input_ids[:size], self.positions[:size], self.q[:size], self.attn_out[:size]
        )

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        """The pieces read only slot_mapping (the cache writes); the rest is never read."""
        unused = torch.zeros(1, dtype=torch.int32, device=self.slot_mapping.device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=unused,
            seq_lens=unused,
            block_tables=unused.view(1, 1),
            max_query_len=size,
            max_seq_len=size,
            query_lens_cpu=[size],
            seq_lens_cpu=[size],
        )

    @torch.inference_mode()
    def capture(self) -> tuple[float, int]:
        """Captures every size's pieces, largest first so smaller ones reuse the pool. Returns (secs,
        bytes)."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        for size in reversed(self.sizes):
            # tensor parallel: the custom all-reduce's kernels in these forwards (graph_forwards)
            with graph_forwards(), forward_context(self._capture_metadata(size), self.kv_caches):
                for _ in self._pieces(size):  # warm-up: Triton compiles outside the capture
                    pass
                torch.cuda.synchronize()
                self.graphs[size] = self._capture_pieces(size)
        torch.cuda.synchronize()
        return time.perf_counter() - started, free_before - torch.cuda.mem_get_info()[0]

    def _capture_pieces(self, size: int) -> list[torch.cuda.CUDAGraph]:
        pieces = self._pieces(size)
        graphs = []
        while True:
            graph = torch.cuda.CUDAGraph()
            finished = False
            with keep_allocator_cache(first=self.pool is None), torch.cuda.graph(graph, pool=self.pool):
                try:
                    next(pieces)
                except StopIteration as stop:
                    self.outputs[size] = stop.value
                    finished = True
            if self.pool is None:
                self.pool = graph.pool()
            graphs.append(graph)
            if finished:
                return graphs

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        return smallest_size_holding(self.sizes, num_tokens, f"a step of {num_tokens} tokens")

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The step's forward: hidden states [T, hidden]. Call inside forward_context(metadata, ...),
        whose metadata the attention cores read; input_ids must hold every token (none in flight)."""
        num_tokens = input_ids.shape[0]
        size = self.padded_size(num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping, non_blocking=True)
        if size > num_tokens:  # padding rows keep earlier tokens and positions, but write to slot 0
            self.slot_mapping[num_tokens:size].zero_()
        graphs = self.graphs[size]
        q, out = self.q[:num_tokens], self.attn_out[:num_tokens]
        for layer, graph in zip(self.attention_layers, graphs):
            graph.replay()
            layer.attend_cached(q, out=out)
        graphs[-1].replay()
        self.steps_run += 1
        return self.outputs[size][:num_tokens]
