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

Memory. The caller's logits [R, V] (the model dtype on CUDA, d bytes a logit) are only read. Whatever
edits or filters logits works on float32 copies of at most SAMPLER_ROWS_PER_CHUNK rows (c rows x V
below), one chunk after another, each chunk's ids written into the output before the next copy is made,
so the float32 working set does not grow with R. Live at once on a CUDA device beside the logits, in
bytes per logit (the planner's sampling term, planner/memory_estimates.py, counts the largest):

  path or stage                                    alive at its peak
  greedy rows without edits                        nothing of [R, V]: one argmax read of every row
  random rows, race kernel, no edit nor filter     nothing of [R, V]; beside greedy rows, the random
                                                   rows' logits gathered for the kernel: d x R_random
  --- a float32 chunk of c rows: edited greedy rows; random rows with a filter, an edit, or without the
      race kernel (CPU, or a row with its own generator) ---
  the chunk's copy                                 4 (+ d while a gathered chunk widens)
  allowed_token_ids / bitmasks / bad words, bias   4 + ~9 (mask, the rows edited, their new values)
  penalties: repetition / frequency, presence      4 + ~18 / 4 + ~25 (seen or counts, where() operands)
  temperature, min_p                               4 (+ 1, a mask)
  top_k                                            4 + 1 (a mask) + 12 x k / V (values and ids); past
                                                   k = 4096 torch sorts them with scratch, so rows go
                                                   through topk a few at a time (at most 8 MiB a pass)
  top_p                                            4 + 4 (the limited rows, in a mixed chunk) + 12
                                                   (sorted values, int64 ids) + 32 (torch's CUDA sort
                                                   scratch below 128 rows) = 52, the largest
  race kernel / torch race                         4 / 4 + 4 (softmax) + 4 (draws) + 4 (unseeded draws)
  --- after the sampling ---
  logprobs, c rows at a time                       d (gathered) + 4 (float32) + 4 (log_softmax) + 1

Stage temporaries are dropped as the next stage starts (top-p's sort, softmax and cumulative sum are
freed one by one).

Tokens are bitwise those of sampling all rows in one float32 copy wherever that is deterministic: every
stage is per row, and per-request generators draw per row. The draws shared by rows without a generator
are taken chunk by chunk: on the CPU the same numbers in the same order (torch's CPU generator is
sequential); on CUDA the race kernel numbers its draws by the row within the chunk, so each chunk after
the first draws a seed of its own, and torch's CUDA exponential draws differ by chunk too: on CUDA a
step of more than SAMPLER_ROWS_PER_CHUNK random rows through float32 gets other (equally distributed)
draws than one copy of all rows would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fitserve.core.outputs import TokenLogprobs
from fitserve.core.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from fitserve.planner.memory_estimates import SAMPLER_ROWS_PER_CHUNK
from fitserve.worker.logits_processors import (
    apply_allowed_token_ids,
    apply_grammar_bitmasks,
    apply_logit_bias,
    apply_penalties,
    ban_bad_words,
    mask_stop_tokens_before_min_tokens,
)
from fitserve.worker.sampling_filters import RandomRowParams, apply_min_p, apply_top_k, apply_top_p
from fitserve.worker.tensor_index import index_tensor, row_floats
from fitserve.worker.transfer import start_copies_to_host_aside


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
        edited_greedy: list[int] = []
        random: list[int] = []
        wants_logprobs: list[int] = []
        filtered = row_edits = False
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature < GREEDY_TEMPERATURE_EPS:
                greedy.append(i)
                if _edits_logits(row):
                    edited_greedy.append(i)
                    row_edits = True
            else:
                random.append(i)
                if not filtered and _has_filters(row):
                    filtered = True
                if not row_edits and _edits_logits(row):
                    row_edits = True
            if p.logprobs is not None:
                wants_logprobs.append(i)
        # The caller's logits (the model dtype on CUDA) are only read: the argmax and race kernels read
        # them as they are; whatever edits or filters them works on float32 copies of a few rows at a time.
        device = logits.device
        sampled = None
        if greedy:
            sampled = _sample_greedy(logits, rows, greedy, edited_greedy)
        if random:
            random_idx = None if len(random) == len(rows) else index_tensor(random, device)
            random_ids = _sample_random_rows(logits, rows, random, random_idx, filtered, row_edits)
            if sampled is None or random_idx is None:
                sampled = random_ids
            else:
                sampled[random_idx] = random_ids
        if sampled is None:  # no rows
            sampled = torch.empty(0, dtype=torch.long, device=device)

        logprob_tensors = None
        if wants_logprobs:
            everyone = len(wants_logprobs) == len(rows)
            idx = None if everyone else index_tensor(wants_logprobs, logits.device)
            chosen = sampled if idx is None else sampled[idx]
            num_tops = [rows[i].params.logprobs or 0 for i in wants_logprobs]
            logprob_tensors = LogprobTensors.from_logits(logits, idx, chosen, num_tops)
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
    def from_logits(
        cls, logits: torch.Tensor, idx: torch.Tensor | None, token_ids: torch.Tensor, num_tops: list[int]
    ) -> LogprobTensors:
        """From the raw log_softmax of the logits rows `idx` (None: every row), in float32 a chunk of
        SAMPLER_ROWS_PER_CHUNK rows at a time: token_ids [rows] are the chosen ids, num_tops[j] how
        many top tokens row j asks for."""
        num_rows = len(num_tops)
        max_top = min(max(num_tops), logits.shape[1])
        parts = [
            _logprob_chunk(
                logits, idx, token_ids, first, min(first + SAMPLER_ROWS_PER_CHUNK, num_rows), max_top
            )
            for first in range(0, num_rows, SAMPLER_ROWS_PER_CHUNK)
        ]
        if len(parts) == 1:
            chosen, ranks, top_logprobs, top_ids = parts[0]
        else:
            chosen, ranks = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            top_logprobs = torch.cat([p[2] for p in parts]) if max_top > 0 else None
            top_ids = torch.cat([p[3] for p in parts]) if max_top > 0 else None
        return cls(
            chosen_ids=token_ids,
            chosen_logprobs=chosen,
            chosen_ranks=ranks,
            top_logprobs=top_logprobs,
            top_ids=top_ids,
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
    token_ids = index_tensor(next_token_ids, logits.device)
    return LogprobTensors.from_logits(logits, None, token_ids, [num_top] * len(next_token_ids)).entries()


def _logprob_chunk(
    logits: torch.Tensor,
    idx: torch.Tensor | None,
    token_ids: torch.Tensor,
    first: int,
    last: int,
    max_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rows first..last of LogprobTensors.from_logits: the chosen tokens' logprobs and ranks, and the
    max_top best logprobs and ids (None when max_top is 0)."""
    rows = logits[first:last] if idx is None else logits[idx[first:last]]
    logprobs = torch.log_softmax(rows.to(torch.float32), dim=-1)
    del rows
    chosen = logprobs.gather(1, token_ids[first:last].unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    top = logprobs.topk(max_top, dim=-1) if max_top > 0 else None
    return chosen.squeeze(1), ranks, *((top.values, top.indices) if top is not None else (None, None))


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


def _sample_greedy(
    logits: torch.Tensor, rows: list[SamplingRow], greedy: list[int], edited: list[int]
) -> torch.Tensor:
    """int64 [len(rows)] whose `greedy` positions hold those rows' argmax (the others are left for the
    random rows). Rows without edits read the caller's logits in one argmax over every row (widening
    to float32 is exact, so the model dtype gives the same ids); the `edited` ones (a subset of greedy)
    go through float32 chunks."""
    if len(edited) < len(greedy):
        sampled = argmax_rows(logits)
    elif len(edited) == len(rows):  # every row greedy and edited
        return _in_float32_chunks(logits, None, rows, True, _argmax_chunk)
    else:
        sampled = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if edited:
        idx = index_tensor(edited, logits.device)
        sampled[idx] = _in_float32_chunks(logits, idx, [rows[i] for i in edited], True, _argmax_chunk)
    return sampled


def _argmax_chunk(block: torch.Tensor, rows: list[SamplingRow], first: int, last: int) -> torch.Tensor:
    return argmax_rows(block)


def _sample_random_rows(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    random: list[int],
    idx: torch.Tensor | None,
    filtered: bool,
    row_edits: bool,
) -> torch.Tensor:
    """int64 [len(random)]: the tokens of the random rows `random` (positions in rows, on the device as
    idx; None when they are every row), in that order. filtered: a random row asks for top_k, top_p or
    min_p; row_edits: some row's logits are edited."""
    device = logits.device
    random_rows = [rows[i] for i in random]
    race_kernel = _race_kernel(logits, random_rows)
    if race_kernel is not None and not filtered and not row_edits:
        # the race in one read of the logits in the model dtype, its draws from a seed of torch's generator
        temperature = row_floats([row.params.temperature for row in random_rows], device)
        seed = torch.randint(0, 2**62, (1,), device=device)
        own = logits if idx is None else logits[idx]
        return race_kernel.race_rows(own, seed, scale=temperature.reciprocal())
    params = RandomRowParams.of([row.params for row in random_rows], logits.shape[1], device)

    def sample_chunk(
        block: torch.Tensor, chunk_rows: list[SamplingRow], first: int, last: int
    ) -> torch.Tensor:
        return _sample_random(block, chunk_rows, race_kernel, filtered, params.rows(first, last))

    return _in_float32_chunks(logits, idx, random_rows, row_edits, sample_chunk)


ChunkSampler = Callable[[torch.Tensor, list[SamplingRow], int, int], torch.Tensor]


def _in_float32_chunks(
    logits: torch.Tensor,
    idx: torch.Tensor | None,
    group_rows: list[SamplingRow],
    row_edits: bool,
    sample_chunk: ChunkSampler,
) -> torch.Tensor:
    """int64 [len(group_rows)]: the rows `idx` of logits (None: every row, in order), whose SamplingRows
    are group_rows, sampled SAMPLER_ROWS_PER_CHUNK rows at a time by sample_chunk(block, chunk_rows,
    first, last) from a float32 copy `block` of rows first..last of the group, edited first when
    row_edits. One chunk's copy and temporaries are freed before the next chunk's are made."""
    num_rows = len(group_rows)
    if num_rows <= SAMPLER_ROWS_PER_CHUNK:
        return _float32_chunk_ids(logits, idx, group_rows, 0, num_rows, row_edits, sample_chunk)
    sampled = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    for first in range(0, num_rows, SAMPLER_ROWS_PER_CHUNK):
        last = min(first + SAMPLER_ROWS_PER_CHUNK, num_rows)
        sampled[first:last] = _float32_chunk_ids(
            logits, idx, group_rows, first, last, row_edits, sample_chunk
        )
    return sampled


def _float32_chunk_ids(
    logits: torch.Tensor,
    idx: torch.Tensor | None,
    group_rows: list[SamplingRow],
    first: int,
    last: int,
    row_edits: bool,
    sample_chunk: ChunkSampler,
) -> torch.Tensor:
    # A copy: the caller's logits stay as they are (a gather is one already). It lives in this frame
    # alone, so it is freed when the chunk's ids come back.
    if idx is None:
        block = logits[first:last].to(torch.float32, copy=True)
    else:
        block = logits[idx[first:last]].to(torch.float32)
    chunk_rows = group_rows[first:last]
    if row_edits:  # each edit leaves a row alone unless _edits_logits holds for it
        apply_allowed_token_ids(block, chunk_rows)
        apply_logit_bias(block, chunk_rows)
        ban_bad_words(block, chunk_rows)
        apply_grammar_bitmasks(block, chunk_rows)
        apply_penalties(block, chunk_rows)
        mask_stop_tokens_before_min_tokens(block, chunk_rows)
    return sample_chunk(block, chunk_rows, first, last)


def _sample_random(
    logits: torch.Tensor, rows: list[SamplingRow], race_kernel: Any, filtered: bool, params: RandomRowParams
) -> torch.Tensor:
    """logits [R, V] (a float32 chunk, after the edits) of random rows -> sampled ids [R]. race_kernel:
    _race_kernel's answer for these rows; filtered: any row of the step asks for top_k, top_p or min_p.
    Modifies logits unless the race kernel runs without filters."""
    device = logits.device
    if race_kernel is not None:
        # the race below in one read of the logits, its draws from a seed of torch's generator (one per
        # chunk: the kernel numbers its draws by the row within the tensor it is given)
        seed = torch.randint(0, 2**62, (1,), device=device)
        if not filtered:
            return race_kernel.race_rows(logits, seed, scale=params.temperature.reciprocal())
    logits.div_(params.temperature.unsqueeze(1))
    apply_top_k(logits, params)
    apply_top_p(logits, params)
    apply_min_p(logits, params)
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
