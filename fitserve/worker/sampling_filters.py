"""The random rows' filters, top_k, top_p and min_p, in place on float32 logits of a few rows (the
sampler's chunks, worker/sampler.py), from their parameters uploaded once a step (`RandomRowParams`).

Each filter leaves a row alone unless it asks for that filter, and skips the batch when none does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitserve.core.sampling_params import SamplingParams
from fitserve.worker.tensor_index import index_tensor, row_floats
from fitserve.worker.transfer import to_device


@dataclass
class RandomRowParams:
    """The random rows' temperatures and filters, uploaded once a step (a chunk takes slices): host lists
    say which filters any row asks for, and the device columns [rows, 1] hold what each chunk's filters
    read (None where no row asks for that filter)."""

    temperature: torch.Tensor  # [rows]
    top_ks: list[int]  # 0 = keep every token
    kth_index: torch.Tensor | None  # k - 1 (0 where k is 0)
    keeps_all: torch.Tensor | None  # bool: k is 0
    top_ps: list[float]
    top_p: torch.Tensor | None
    min_ps: list[float]
    log_min_p: torch.Tensor | None  # log(min_p): -inf where min_p is 0

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> RandomRowParams:
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        kth_index = keeps_all = top_p = log_min_p = None
        if any(top_ks):
            k = to_device(top_ks, torch.long, device).unsqueeze(1)
            kth_index, keeps_all = (k - 1).clamp_(min=0), k == 0
        if any(p < 1.0 for p in top_ps):
            top_p = row_floats(top_ps, device).unsqueeze(1)
        if any(p > 0.0 for p in min_ps):
            log_min_p = torch.log(row_floats(min_ps, device).unsqueeze(1))
        return cls(
            row_floats([p.temperature for p in params], device),
            top_ks,
            kth_index,
            keeps_all,
            top_ps,
            top_p,
            min_ps,
            log_min_p,
        )

    def rows(self, first: int, last: int) -> RandomRowParams:
        def part(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[first:last]

        return RandomRowParams(
            self.temperature[first:last],
            self.top_ks[first:last],
            part(self.kth_index),
            part(self.keeps_all),
            self.top_ps[first:last],
            part(self.top_p),
            self.min_ps[first:last],
            part(self.log_min_p),
        )


# topk sorts the values it selects: up to 4096 a row in place, more through a full sort with its scratch
# (~64 bytes a selected value). Rows go through it in groups of at most this many selected values, so a
# top_k near the vocabulary adds a few MiB, not several float32 copies of the chunk.
TOP_K_VALUES_PER_PASS = 32 * 4096


def apply_top_k(logits: torch.Tensor, params: RandomRowParams) -> None:
    """-inf below each row's k-th largest logit (rows with top_k 0 keep everything)."""
    if params.kth_index is None or params.keeps_all is None or not any(params.top_ks):
        return
    rows_per_pass = max(1, TOP_K_VALUES_PER_PASS // max(params.top_ks))
    for first in range(0, logits.shape[0], rows_per_pass):
        last = first + rows_per_pass
        max_k = max(params.top_ks[first:last])
        if max_k == 0:
            continue
        rows = logits[first:last]  # a view: the masks below land in logits
        top_values = rows.topk(max_k, dim=-1).values
        kth_value = top_values.gather(1, params.kth_index[first:last])
        kth_value.masked_fill_(params.keeps_all[first:last], -torch.inf)
        rows.masked_fill_(rows < kth_value, -torch.inf)


def apply_top_p(logits: torch.Tensor, params: RandomRowParams) -> None:
    """Keep a token if the probability of the tokens ranked above it is below top_p (so the most
    likely token always stays). Ties rank by token id, lowest first."""
    limited = [j for j, p in enumerate(params.top_ps) if p < 1.0]
    if params.top_p is None or not limited:
        return
    if len(limited) == len(params.top_ps):
        _drop_outside_top_p(logits, params.top_p)
        return
    idx = index_tensor(limited, logits.device)
    block = logits[idx]
    _drop_outside_top_p(block, params.top_p[idx])
    logits[idx] = block


def _drop_outside_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place on logits [rows, V] (top_p [rows, 1]). Each [rows, V] temporary is dropped as soon as
    the next one no longer needs it; the sort's own scratch is gone once it returns."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    del sorted_logits
    mass_above = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
    del sorted_probs
    drop_sorted = mass_above >= top_p
    del mass_above
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    del order, drop_sorted
    logits.masked_fill_(drop, -torch.inf)


def apply_min_p(logits: torch.Tensor, params: RandomRowParams) -> None:
    """Drop tokens with probability below min_p * (the top probability): in logit space,
    logit < max_logit + log(min_p)."""
    if params.log_min_p is None or not any(p > 0.0 for p in params.min_ps):
        return
    threshold = logits.amax(dim=-1, keepdim=True) + params.log_min_p
    logits.masked_fill_(logits < threshold, -torch.inf)
