"""The collectives a tensor-parallel forward and step need, as no-ops on one rank.

- all_reduce: the sum of every rank's partial output (row-parallel linears, the vocab-parallel
  embedding);
- gather_logits: every rank's slice of the vocabulary, joined on the first rank only (the one that
  samples, or with pipeline stages the last stage's first rank, which sends them on); the others get None;
- broadcast_from_first: the first rank's sampled ids to every rank, so each reads a token still in
  flight from its own copy on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fitserve.distributed.parallel_state import tp


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the ranks, in place; returns x."""
    state = tp()
    if state.size > 1:
        dist.all_reduce(x, group=state.group)
    return x


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
