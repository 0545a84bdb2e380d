"""The collectives a tensor-parallel forward and step need, as no-ops on one rank.

- all_reduce: the sum of every rank's partial output (row-parallel linears, the vocab-parallel
  embedding), through fitserve's own one-shot kernel for small sums in the CUDA graphs' forwards
  (custom_all_reduce.py, graph_forwards);
- all_reduce_add_rms_norm: that sum added to the residual stream and normalised, one kernel on GPUs
  where the custom all-reduce runs;
- gather_logits: every rank's slice of the vocabulary, joined on the first rank only (the one that
  samples, or with pipeline stages the last stage's first rank, which sends them on); the others get None;
- broadcast_from_first: the first rank's sampled ids to every rank, so each reads a token still in
  flight from its own copy on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fitserve.distributed.parallel_state import tp


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the ranks, in place; returns x. Small sums on GPUs that run it go through
    distributed/custom_all_reduce.py, the rest through the group's backend (NCCL, gloo)."""
    state = tp()
    if state.size > 1:
        custom = _in_graph(state.custom_all_reduce)
        if custom is not None and custom.takes(x):
            return custom(x)
        dist.all_reduce(x, group=state.group)
    return x


# True while the graph runners warm up and capture their forwards (graph_forwards).
_graph_forwards = False


@contextlib.contextmanager
def graph_forwards() -> Iterator[None]:
    """Inside, the custom all-reduce takes the small sums (where the group has one): worker/cuda_graphs.py
    and piecewise_graphs.py run their warm-up forwards (which compile its kernels before any capture) and
    their captures in here, so it runs in every graph replay. Every rank warms up and captures the same
    graphs in the same order, so all ranks take the same path for every call."""
    global _graph_forwards
    before = _graph_forwards
    _graph_forwards = True
    try:
        yield
    finally:
        _graph_forwards = before


def _in_graph(custom: Any) -> Any:
    """The custom all-reduce inside graph_forwards, else None. Its kernels pay in graph replays: eagerly
    each call's launch on the host costs about what NCCL's does (benchmarks/results/h200x2_tp.json,
    "allreduce"), and eager steps (prompt chunks past the captured sizes, --enforce-eager) keep NCCL."""
    return custom if _graph_forwards else None


def all_reduce_add_rms_norm(
    partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: the sum over the ranks of `partial` (a row-parallel layer's output before its all-reduce) added
    to `residual`, and that normalised (kernels/norm.py fused_add_rms_norm's semantics); in place like it,
    returns (normed, residual). One kernel where the custom all-reduce takes the rows (in the graph
    runners' forwards: `graph_forwards`), else the all-reduce and then the norm."""
    from fitserve.kernels.norm import fused_add_rms_norm

    state = tp()
    custom = _in_graph(state.custom_all_reduce)
    if state.size > 1 and custom is not None and custom.takes_norm(partial, residual, weight):
        return custom.add_rms_norm(partial, residual, weight, eps)
    return fused_add_rms_norm(all_reduce(partial), residual, weight, eps)


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """local [N, vocab_per_rank] on every rank -> [N, vocab_size] on the first rank (padding rows of the
    vocabulary dropped), None on the others."""
    state = tp()
    if state.size == 1:
        return local[:, :vocab_size] if local.shape[-1] != vocab_size else local
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(state.size)] if state.is_first else None
    dist.gather(local, parts, dst=state.first_global_rank, group=state.group)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size]


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """x as the first rank holds it, on every rank (in place); returns x."""
    state = tp()
    if state.size > 1:
        dist.broadcast(x, src=state.first_global_rank, group=state.group)
    return x
