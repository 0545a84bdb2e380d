"""Sampler: greedy is torch.argmax, filters keep the right tokens, penalties match a hand computation,
seeded rows do not depend on the batch, logprobs are the raw log_softmax, sampling follows the
temperature-scaled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from fitserve.core.sampling_params import SamplingParams
from fitserve.worker.logits_processors import apply_penalties, mask_stop_tokens_before_min_tokens
from fitserve.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs

VOCAB = 512
sampler = Sampler()


def row(
    params: SamplingParams,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplingRow:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, prompt or [0], output or [], generator, eos)


def random_logits(batch: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn((batch, vocab), generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(16, seed=1)
    out = sampler(logits, [row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_ties_take_the_lowest_id() -> None:
    logits = torch.zeros((2, 8))
    logits[0, [3, 5, 6]] = 4.0
    logits[1, [7, 2]] = 1.0
    out = sampler(logits, [row(SamplingParams(temperature=0.0)) for _ in range(2)])
    assert out.sampled_token_ids == [3, 2]


def test_greedy_does_not_change_the_callers_logits() -> None:
    logits = random_logits(2, seed=2)
    before = logits.clone()
    sampler(logits, [row(SamplingParams(temperature=0.0, repetition_penalty=1.5), output=[1, 2])] * 2)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=4),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05),
    ],
    ids=["greedy", "greedy min_tokens", "random filters"],
)
def test_no_path_changes_the_callers_logits(params: SamplingParams) -> None:
    logits = random_logits(3, seed=5)
    before = logits.clone()
    sampler(logits, [row(params, output=[1], eos=frozenset({int(before[0].argmax())})) for _ in range(3)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=0.8, top_k=1, seed=11),
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1 seeded"],
)
def test_filters_that_keep_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = random_logits(32, seed=3)
    out = sampler(logits, [row(params) for _ in range(32)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def draws(logits_row: list[float], params: SamplingParams, num_draws: int = 4000) -> torch.Tensor:
    """Token counts over `num_draws` independent samples of the same distribution (one batch)."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(num_draws, -1).contiguous()
    out = sampler(logits, [row(params) for _ in range(num_draws)])
    return torch.bincount(torch.tensor(out.sampled_token_ids), minlength=len(logits_row))


PROBS = [0.4, 0.3, 0.2, 0.1]
LOGITS = [math.log(p) for p in PROBS]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(min_p=0.6), {0, 1}),  # keep p >= 0.6 * 0.4 = 0.24
        (SamplingParams(min_p=0.45), {0, 1, 2}),  # keep p >= 0.18
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.65), {0, 1}),  # mass above token 2 is 0.7 >= 0.65
        (SamplingParams(top_p=0.75), {0, 1, 2}),
    ],
    ids=["min_p=0.6", "min_p=0.45", "top_k=2", "top_p=0.65", "top_p=0.75"],
)
def test_filters_keep_exactly_the_allowed_tokens(params: SamplingParams, allowed: set[int]) -> None:
    torch.manual_seed(0)
    counts = draws(LOGITS, params)
    seen = {i for i, c in enumerate(counts.tolist()) if c > 0}
    assert seen == allowed


def test_temperature_sampling_follows_the_scaled_distribution() -> None:
    torch.manual_seed(1234)
    num_draws = 20000
    for temperature in (1.0, 0.5, 2.0):
        expected = torch.softmax(torch.tensor(LOGITS) / temperature, dim=-1)
        counts = draws(LOGITS, SamplingParams(temperature=temperature), num_draws)
        frequencies = counts.float() / num_draws
        # Standard error is at most 0.0036 at 20000 draws; 0.02 is more than 5 of them.
        assert torch.allclose(frequencies, expected, atol=0.02), (temperature, frequencies, expected)


def test_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [row(params, prompt=[0, 1], output=[2, 2, 4])])
    # repetition over prompt+output {0, 1, 2, 4}: 2/2, -1*2, 0.5/2, -2*2
    # frequency/presence over output (token 2 twice, token 4 once): 0.25 - 1 - 0.25, -4 - 0.5 - 0.25
    expected = torch.tensor([[1.0, -2.0, -1.0, 3.0, -4.75, 1.0]])
    assert torch.allclose(logits, expected, atol=1e-6), logits


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [
        row(SamplingParams(), prompt=[2], output=[2]),
        row(SamplingParams(frequency_penalty=1.0), prompt=[0], output=[2, 2, 1]),
        row(SamplingParams(repetition_penalty=3.0), prompt=[2], output=[]),
    ]
    apply_penalties(logits, rows)
    expected = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [1.0, 2.0, 1.0]])
    assert torch.allclose(logits, expected), logits


def test_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0]])
    plain = sampler(logits, [row(SamplingParams(temperature=0.0), output=[1, 1])])
    penalised = sampler(logits, [row(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[1, 1])])
    assert plain.sampled_token_ids == [1]
    assert penalised.sampled_token_ids == [2]


def test_min_tokens_blocks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros((4, 8))
    logits[:, 7] = 50.0  # eos
    logits[:, 6] = 40.0  # a stop token
    logits[:, 3] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    eos = frozenset({7})
    rows = [
        row(params, output=[1], eos=eos),  # 1 < 3: eos and 6 blocked
        row(params, output=[1, 2], eos=eos),  # 2 < 3: blocked
        row(params, output=[1, 2, 3], eos=eos),  # reached: eos allowed
        row(SamplingParams(temperature=0.0, min_tokens=3), output=[], eos=frozenset()),  # ignore_eos
    ]
    assert sampler(logits, rows).sampled_token_ids == [3, 3, 7, 7]
    random_rows = [
        row(SamplingParams(min_tokens=5, stop_token_ids=[6]), output=[], eos=eos) for _ in range(64)
    ]
    sampled = sampler(logits[:1].expand(64, -1), random_rows).sampled_token_ids
    assert 7 not in sampled and 6 not in sampled


def test_min_tokens_masks_in_place_only_blocked_rows() -> None:
    logits = torch.zeros((2, 4))
    params = SamplingParams(min_tokens=1, stop_token_ids=[1])
    mask_stop_tokens_before_min_tokens(
        logits, [row(params, output=[], eos=frozenset({3})), row(params, output=[0], eos=frozenset({3}))]
    )
    assert logits.tolist() == [[0.0, -math.inf, 0.0, -math.inf], [0.0, 0.0, 0.0, 0.0]]


def run_seeded(seed: int, batches: list[tuple[int, SamplingParams]], steps: int = 12) -> list[int]:
    """Samples `steps` tokens for one seeded row placed at a different position each step among other
    rows; returns that row's tokens. batches[i] = (batch size, params of the other rows)."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=seed)
    tokens = []
    for step in range(steps):
        batch_size, other_params = batches[step % len(batches)]
        position = step % batch_size
        logits = random_logits(batch_size, seed=1000 + step * 7 + batch_size)
        own_logits = random_logits(1, seed=step)[0]
        logits[position] = own_logits
        rows = [row(other_params) for _ in range(batch_size)]
        rows[position] = SamplingRow(params, [1, 2], list(tokens), generator, frozenset())
        tokens.append(sampler(logits, rows).sampled_token_ids[position])
    return tokens


def test_seeded_row_does_not_depend_on_the_batch() -> None:
    alone = run_seeded(7, [(1, SamplingParams())])
    mixed = run_seeded(7, [(5, SamplingParams()), (3, SamplingParams(temperature=0.0))])
    crowded = run_seeded(7, [(9, SamplingParams(top_k=3, seed=99)), (2, SamplingParams(min_p=0.2))])
    other_seed = run_seeded(8, [(1, SamplingParams())])
    assert alone == mixed == crowded
    assert alone != other_seed  # the seed matters (12 draws from ~100 tokens)


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros((64, VOCAB))
    out = sampler(logits, [row(SamplingParams()) for _ in range(64)])
    assert len(set(out.sampled_token_ids)) > 32


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = random_logits(6, seed=5)
    params = [
        SamplingParams(logprobs=5, repetition_penalty=1.7, temperature=0.7),
        SamplingParams(logprobs=0),
        SamplingParams(),
        SamplingParams(logprobs=3, temperature=0.0),
        SamplingParams(logprobs=20, top_k=3),
        SamplingParams(logprobs=2, temperature=0.0, presence_penalty=2.0),
    ]
    rows = [row(p, output=[int(logits[i].argmax())]) for i, p in enumerate(params)]
    out = sampler(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        entry = out.logprobs[i]
        if p.logprobs is None:
            continue
        assert entry is not None
        sampled = out.sampled_token_ids[i]
        assert entry.token_ids[0] == sampled
        assert len(entry.token_ids) == len(entry.logprobs) == len(entry.ranks) == 1 + p.logprobs
        for token_id, logprob in zip(entry.token_ids, entry.logprobs, strict=True):
            assert abs(logprob - reference[i, token_id].item()) < 1e-6
        assert entry.ranks[0] == int((reference[i] > reference[i, sampled]).sum()) + 1
        order = torch.argsort(reference[i], descending=True).tolist()
        assert entry.token_ids[1:] == order[: p.logprobs]
        assert entry.ranks[1:] == list(range(1, p.logprobs + 1))
    # Row 5: presence penalty made greedy pick the second best; its raw rank says so.
    assert out.logprobs[5].ranks[0] == 2


def test_compute_prompt_logprobs() -> None:
    logits = random_logits(4, seed=6, vocab=50)
    next_ids = [3, 10, 49, 0]
    entries = compute_prompt_logprobs(logits, next_ids, num_top=2)
    reference = torch.log_softmax(logits, dim=-1)
    for i, entry in enumerate(entries):
        assert entry.token_ids[0] == next_ids[i]
        assert abs(entry.logprobs[0] - reference[i, next_ids[i]].item()) < 1e-6
        assert entry.ranks[0] == int((reference[i] > reference[i, next_ids[i]]).sum()) + 1
        assert entry.token_ids[1:] == torch.argsort(reference[i], descending=True)[:2].tolist()
        assert entry.ranks[1:] == [1, 2]
    assert compute_prompt_logprobs(logits[:0], [], 3) == []


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"logits of shape \(3, 512\) do not match 2 sampling rows"):
        sampler(random_logits(3, seed=0), [row(SamplingParams())] * 2)
