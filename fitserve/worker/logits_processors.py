"""The sampler's in-place edits of a batch's logits, each only for the rows that ask for it (a batch where
no row does costs one check per row): allowed_token_ids, logit_bias, bad_words, structured outputs'
grammar bitmasks, the repetition, frequency and presence penalties, and min_tokens' ban on stop tokens.
fitserve/worker/sampler.py runs them in that order (vLLM's)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from fitserve.worker.tensor_index import flat_token_index, index_tensor, row_floats

if TYPE_CHECKING:
    from fitserve.worker.sampler import SamplingRow


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf for every token outside the allowed_token_ids of rows that set them."""
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not limited:
        return
    device = logits.device
    vocab_size = logits.shape[1]
    allowed_rows, allowed_tokens = flat_token_index(
        [(t for t in rows[i].params.allowed_token_ids or () if t < vocab_size) for i in limited], device
    )
    banned = torch.ones((len(limited), vocab_size), dtype=torch.bool, device=device)
    banned[allowed_rows, allowed_tokens] = False
    idx = index_tensor(limited, device)
    logits[idx] = logits[idx].masked_fill(banned, -torch.inf)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: logits[row, token] += bias for every (token, bias) of each row's logit_bias."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return
    vocab_size = logits.shape[1]
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    for i in biased:
        for token, bias in (rows[i].params.logit_bias or {}).items():
            if token < vocab_size:
                bias_rows.append(i)
                bias_tokens.append(token)
                bias_values.append(bias)
    if bias_tokens:
        device = logits.device
        index = (index_tensor(bias_rows, device), index_tensor(bias_tokens, device))
        logits.index_put_(index, row_floats(bias_values, device), accumulate=True)


def ban_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf for the last token of every bad word whose other tokens end the output (a word of
    one token: always). Rows whose params hold no bad_words_token_ids are untouched."""
    vocab_size = logits.shape[1]
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    for i, row in enumerate(rows):
        sequences = row.params.bad_words_token_ids
        if not sequences:
            continue
        output = row.output_token_ids
        for ids in sequences:
            head, last = ids[:-1], ids[-1]
            if last >= vocab_size or len(head) > len(output):
                continue
            if not head or output[len(output) - len(head) :] == head:
                ban_rows.append(i)
                ban_tokens.append(last)
    if ban_tokens:
        logits[index_tensor(ban_rows, logits.device), index_tensor(ban_tokens, logits.device)] = -torch.inf


def apply_grammar_bitmasks(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf for every token the grammar of a constrained row (row.grammar) does not allow
    next. The matchers fill one host bitmask (int32, a bit per token), unpacked on the logits' device
    (fitserve/structured/bitmask.py). Rows without a grammar are untouched."""
    # a grammar already complete belongs to a request that ended with the last step's token (this row of
    # a deferred sampling is dropped): left unmasked
    constrained = [
        i for i, row in enumerate(rows) if row.grammar is not None and not row.grammar.is_terminated
    ]
    if not constrained:
        return
    from fitserve.structured.batch_fill import fill_bitmasks
    from fitserve.structured.bitmask import apply_bitmask_rows

    width = max(rows[i].grammar.bitmask_width for i in constrained)
    # filled whole by the matchers; pinned for a GPU, so the upload is one asynchronous copy (the pinned
    # allocator keeps the buffer until that copy has run)
    pinned = logits.device.type == "cuda"
    bitmask = torch.empty((len(constrained), width), dtype=torch.int32, pin_memory=pinned)
    fill_bitmasks([rows[i].grammar for i in constrained], bitmask)
    apply_bitmask_rows(logits, bitmask, constrained)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place on float32 logits [B, V]: repetition penalty over prompt + output tokens (positive
    logits divided by it, negative multiplied), then logit -= frequency_penalty * count +
    presence_penalty * (count > 0) over output tokens."""
    _apply_repetition_penalty(logits, rows)
    _apply_frequency_presence_penalties(logits, rows)


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    penalised = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not penalised:
        return
    device = logits.device
    idx = index_tensor(penalised, device)
    seen_rows, seen_tokens = flat_token_index(
        [itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in penalised], device
    )
    seen = torch.zeros((len(penalised), logits.shape[1]), dtype=torch.bool, device=device)
    seen[seen_rows, seen_tokens] = True
    penalty = row_floats([rows[i].params.repetition_penalty for i in penalised], device).unsqueeze(1)
    block = logits[idx]
    scaled = torch.where(block > 0, block / penalty, block * penalty)
    logits[idx] = torch.where(seen, scaled, block)


def _apply_frequency_presence_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    penalised = [
        i
        for i, row in enumerate(rows)
        if row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0
    ]
    if not penalised:
        return
    device = logits.device
    idx = index_tensor(penalised, device)
    count_rows, count_tokens = flat_token_index([rows[i].output_token_ids for i in penalised], device)
    counts = torch.zeros((len(penalised), logits.shape[1]), dtype=torch.float32, device=device)
    counts.index_put_(
        (count_rows, count_tokens), torch.ones_like(count_tokens, dtype=torch.float32), accumulate=True
    )
    frequency = row_floats([rows[i].params.frequency_penalty for i in penalised], device)
    presence = row_floats([rows[i].params.presence_penalty for i in penalised], device)
    logits[idx] -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0).float()


def mask_stop_tokens_before_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: -inf for eos_token_ids and stop_token_ids of rows with fewer than min_tokens outputs."""
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_tokens: list[int] = []
    for i, row in enumerate(rows):
        if row.num_generated >= row.params.min_tokens:
            continue
        banned = sorted(t for t in row.eos_token_ids.union(row.params.stop_token_ids or ()) if t < vocab_size)
        mask_rows.extend([i] * len(banned))
        mask_tokens.extend(banned)
    if mask_tokens:
        logits[index_tensor(mask_rows, logits.device), index_tensor(mask_tokens, logits.device)] = -torch.inf
