"""Batched token sampling: logits [B, V] plus one `SamplingRow` per row -> one token id per row.

Order of operations, per row, all as tensor ops over the batch (no Python loop over the vocabulary):
  1. logprobs are taken from the raw logits (log_softmax of the unprocessed logits, vLLM's default);
  2. allowed_token_ids (every other token gets -inf), then logit_bias is added (vLLM's order);
     both only for rows that set them; then bad_words (a word's last token gets -inf where the output
     ends with its other tokens); then structured outputs: a row with a grammar gets -inf for
     every token its grammar does not allow next (its matcher's bitmask, fitserve/structured);
  3. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
  4. min_tokens: eos and stop_token_ids get -inf while fewer than min_tokens tokens were generated;
  5. greedy rows (temperature < 1e-5) take the argmax of these logits (ties: the lowest id);
  6. random rows: divide by temperature, then top_k, top_p, min_p, softmax, and draw with the
     exponential race argmax(probs / q), q ~ Exp(1). A row with its own generator draws its q from that
     generator alone, so its token depends only on its logits and its generator, never on other rows;
     rows without one share a single draw. On CUDA, when no row has its own generator, the race runs
     in one kernel as argmax(logits / temperature - log q) (the same distribution, kernels/argmax.py),
     reading the logits once when no filter is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fitserve.core.outputs import TokenLogprobs
from fitserve.core.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from fitserve.worker.logits_processors import (
    apply_allowed_token_ids,
    apply_grammar_bitmasks,
    apply_logit_bias,
    apply_penalties,
    ban_bad_words,
    mask_stop_tokens_before_min_tokens,
)
from fitserve.worker.tensor_index import index_tensor, row_floats
from fitserve.worker.transfer import start_copies_to_host_aside, to_device

TOP_P_ROWS_PER_CHUNK = 64


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator when params.seed is set, on the logits' device; None = shared draw.
    generator: torch.Generator | None = None
    # Tokens that end the sequence (empty when params.ignore_eos).
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # Tokens sampled by earlier steps still in flight, not in output_token_ids yet (asynchronous
    # scheduling): they count toward min_tokens. Rows with penalties never have any.
    num_pending_outputs: int = 0
    # Structured outputs: the sequence's grammar state (fitserve/structured/backend.GrammarState);
    # None = unconstrained.
    grammar: Any = None

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) + self.num_pending_outputs

    @cached_property
    def needs_token_history(self) -> bool:
        """Penalties and bad words of several tokens read the exact output tokens, and a grammar's mask
        needs its matcher advanced by every token sampled so far, so the next step must wait for this
        one's. Read once per row: a row's params and grammar are not replaced (the model runner keeps a
        request's row across steps only while both are the request's own)."""
        p = self.params
        return (
            p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
            or self.grammar is not None
            or (bool(p.bad_words_token_ids) and any(len(ids) > 1 for ids in p.bad_words_token_ids))
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # one per row; None where params.logprobs is None


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
        """Queues the sampling work on the logits' device without waiting for it (no host sync)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(rows)} sampling rows: "
                "pass logits [num_rows, vocab_size], one row per SamplingRow"
            )
        # One pass over the rows (this runs for every row of every step): which are greedy, which ask
        # for filters, logprobs, or any edit of their logits.
        greedy: list[int] = []
        random: list[int] = []
        wants_logprobs: list[int] = []
        filtered = row_edits = False
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature < GREEDY_TEMPERATURE_EPS:
                greedy.append(i)
            else:
                random.append(i)
                if not filtered and _has_filters(row):
                    filtered = True
            if not row_edits and _edits_logits(row):
                row_edits = True
            if p.logprobs is not None:
                wants_logprobs.append(i)
        random_rows = [rows[i] for i in random]
        race_kernel = _race_kernel(logits, random_rows) if random else None
        # The caller's logits stay as they are: a copy where anything below edits them in place (the
        # race kernel without filters only reads them).
        edits = row_edits or (bool(random) and (race_kernel is None or filtered))
        # Logits in the model dtype (the LM head's on CUDA) are read as they are by the argmax and race
        # kernels; anything that edits them works on a float32 copy.
        processed = logits.to(torch.float32, copy=True) if edits else logits
        if row_edits:  # each edit below leaves a row alone unless _edits_logits holds for it
            apply_allowed_token_ids(processed, rows)
            apply_logit_bias(processed, rows)
            ban_bad_words(processed, rows)
            apply_grammar_bitmasks(processed, rows)
            apply_penalties(processed, rows)
            mask_stop_tokens_before_min_tokens(processed, rows)

        if not random:
            sampled = argmax_rows(processed)
        elif not greedy:
            sampled = _sample_random(processed, rows, race_kernel, filtered)
        else:
            sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            greedy_idx = index_tensor(greedy, logits.device)
            sampled[greedy_idx] = argmax_rows(processed[greedy_idx])
            random_idx = index_tensor(random, logits.device)
            sampled[random_idx] = _sample_random(processed[random_idx], random_rows, race_kernel, filtered)

        logprob_tensors = None
        if wants_logprobs:
            idx = index_tensor(wants_logprobs, logits.device)
            raw_logprobs = torch.log_softmax(logits[idx].to(torch.float32), dim=-1)
            num_tops = [rows[i].params.logprobs or 0 for i in wants_logprobs]
            logprob_tensors = LogprobTensors.compute(raw_logprobs, sampled[idx], num_tops)
        return PendingSample(sampled, wants_logprobs, logprob_tensors)


@dataclass
class LogprobTensors:
    """Logprobs of chosen tokens and the top-k per row, as tensors (on the device; PendingSample
    copies them to the host)."""

    chosen_ids: torch.Tensor
    chosen_logprobs: torch.Tensor
    chosen_ranks: torch.Tensor
    top_logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    num_tops: list[int]

    @classmethod
    def compute(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, num_tops: list[int]) -> LogprobTensors:
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=-1)
        max_top = min(max(num_tops), logprobs.shape[1])
        top = logprobs.topk(max_top, dim=-1) if max_top > 0 else None
        return cls(
            chosen_ids=token_ids,
            chosen_logprobs=chosen.squeeze(1),
            chosen_ranks=ranks,
            top_logprobs=top.values if top is not None else None,
            top_ids=top.indices if top is not None else None,
            num_tops=num_tops,
        )

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.chosen_ids, self.chosen_logprobs, self.chosen_ranks, self.top_logprobs, self.top_ids)

    def entries(self) -> list[TokenLogprobs]:
        chosen_ids = self.chosen_ids.tolist()
        chosen_logprobs = self.chosen_logprobs.tolist()
        chosen_ranks = self.chosen_ranks.tolist()
        top_logprobs = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        result = []
        for row, num_top in enumerate(self.num_tops):
            k = min(num_top, len(top_ids[row])) if top_ids is not None else 0
            result.append(
                TokenLogprobs(
                    token_ids=[chosen_ids[row], *(top_ids[row][:k] if k else [])],
                    logprobs=[chosen_logprobs[row], *(top_logprobs[row][:k] if k else [])],
                    ranks=[chosen_ranks[row], *range(1, k + 1)],
                )
            )
        return result


class PendingSample:
    """Sampling queued on the device. Its results start their way to the host at once (pinned memory,
    an event), so result() waits for this step alone, never for a step queued after it."""

    def __init__(self, sampled: torch.Tensor, logprob_rows: list[int], logprobs: LogprobTensors | None):
        self.sampled = sampled  # on the device: the next step may read its tokens from here
        self.logprob_rows = logprob_rows
        logprob_parts = list(logprobs.tensors()) if logprobs is not None else []
        hosts, self._ready = start_copies_to_host_aside([sampled, *logprob_parts])
        self._host_sampled = hosts[0]
        self._host_logprobs = None
        if logprobs is not None:
            self._host_logprobs = LogprobTensors(*hosts[1:], num_tops=logprobs.num_tops)

    def result(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        logprobs: list[TokenLogprobs | None] = [None] * self.sampled.shape[0]
        if self._host_logprobs is not None:
            for i, entry in zip(self.logprob_rows, self._host_logprobs.entries(), strict=True):
                logprobs[i] = entry
        return SamplerOutput(sampled_token_ids=self._host_sampled.tolist(), logprobs=logprobs)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of each prompt position's next token (row i scores next_token_ids[i]), plus the top
    `num_top` tokens at that position, from the raw logits."""
    if logits.dim() != 2 or logits.shape[0] != len(next_token_ids):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match {len(next_token_ids)} next tokens: "
            "pass one logits row per scored prompt position"
        )
    if not next_token_ids:
        return []
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_ids = index_tensor(next_token_ids, logits.device)
    return LogprobTensors.compute(logprobs, token_ids, [num_top] * len(next_token_ids)).entries()


def _race_kernel(logits: torch.Tensor, rows: list[SamplingRow]) -> Any:
    """fitserve's one-read exponential race (kernels/argmax.py) when it can take these random rows:
    on CUDA, and no row draws from its own generator; else None."""
    if not logits.is_cuda or any(row.generator is not None for row in rows):
        return None
    from fitserve.kernels import argmax

    return argmax if argmax.supports(logits) else None


def _has_filters(row: SamplingRow) -> bool:
    p = row.params
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _sample_random(
    logits: torch.Tensor, rows: list[SamplingRow], race_kernel: Any, filtered: bool
) -> torch.Tensor:
    """logits [R, V] (after penalties) of random rows -> sampled ids [R]. race_kernel: _race_kernel's
    answer for these rows; filtered: any row asks for top_k, top_p or min_p. Modifies logits unless
    the race kernel runs without filters."""
    device = logits.device
    temperature = row_floats([row.params.temperature for row in rows], device)
    if race_kernel is not None:
        # the race below in one read of the logits, its draws from a seed of torch's generator
        seed = torch.randint(0, 2**62, (1,), device=device)
        if not filtered:
            return race_kernel.race_rows(logits, seed, scale=temperature.reciprocal())
    logits.div_(temperature.unsqueeze(1))
    _apply_top_k(logits, [row.params.top_k for row in rows])
    _apply_top_p(logits, [row.params.top_p for row in rows])
    _apply_min_p(logits, [row.params.min_p for row in rows])
    if race_kernel is not None:
        return race_kernel.race_rows(logits, seed)
    probs = torch.softmax(logits, dim=-1)

    race = torch.empty_like(probs)
    unseeded = [j for j, row in enumerate(rows) if row.generator is None]
    if len(unseeded) == len(rows):
        race.exponential_()
    elif unseeded:
        race[index_tensor(unseeded, device)] = torch.empty(
            (len(unseeded), probs.shape[1]), dtype=probs.dtype, device=device
        ).exponential_()
    for j, row in enumerate(rows):
        if row.generator is not None:
            race[j].exponential_(generator=row.generator)
    # An Exp(1) draw of exactly 0 would give inf (or nan for a masked token); keep it positive.
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return argmax_rows(probs.div_(race))


def _edits_logits(row: SamplingRow) -> bool:
    """True when penalties, min_tokens, logit_bias, allowed_token_ids, bad_words or a grammar change
    this row's logits."""
    p = row.params
    return (
        p.logit_bias is not None
        or p.allowed_token_ids is not None
        or bool(p.bad_words_token_ids)
        or row.needs_token_history
        or (p.min_tokens > 0 and row.num_generated < p.min_tokens)
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] -> each row's argmax (the lowest index on ties), int64 [rows]: on CUDA through
    fitserve's two-launch kernel (kernels/argmax.py; torch's one-pass reduction took 27 us for one row
    of 128,256), elsewhere torch.argmax."""
    if x.is_cuda:
        from fitserve.kernels import argmax

        if argmax.supports(x):
            return argmax.argmax_rows(x)
    return x.argmax(dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> None:
    vocab_size = logits.shape[1]
    ks = [k if 0 < k < vocab_size else 0 for k in top_ks]  # 0 = keep everything
    if not any(ks):
        return
    k = to_device(ks, torch.long, logits.device).unsqueeze(1)
    top_values = logits.topk(max(ks), dim=-1).values
    kth_value = top_values.gather(1, (k - 1).clamp(min=0))
    kth_value = torch.where(k > 0, kth_value, torch.full_like(kth_value, -torch.inf))
    logits.masked_fill_(logits < kth_value, -torch.inf)


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> None:
    """Keep a token if the probability of the tokens ranked above it is below top_p (so the most
    likely token always stays). Ties rank by token id, lowest first."""
    limited = [j for j, p in enumerate(top_ps) if p < 1.0]
    if not limited:
        return
    device = logits.device
    # Rows go through the sort in chunks: a full-vocabulary sort of every row at once would hold
    # several [rows, vocab] temporaries (values, int64 indices, probabilities, sums) at the same time.
    for first in range(0, len(limited), TOP_P_ROWS_PER_CHUNK):
        chunk = limited[first : first + TOP_P_ROWS_PER_CHUNK]
        idx = index_tensor(chunk, device)
        block = logits[idx]
        top_p = row_floats([top_ps[j] for j in chunk], device).unsqueeze(1)
        sorted_logits, order = block.sort(dim=-1, descending=True, stable=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_above >= top_p
        drop_sorted[:, 0] = False
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits[idx] = block.masked_fill(drop, -torch.inf)


def _apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> None:
    """Drop tokens with probability below min_p * (the top probability): in logit space,
    logit < max_logit + log(min_p)."""
    if not any(p > 0.0 for p in min_ps):
        return
    min_p = row_floats(min_ps, logits.device).unsqueeze(1)
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    logits.masked_fill_(logits < threshold, -torch.inf)
