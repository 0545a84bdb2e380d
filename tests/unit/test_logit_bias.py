"""logit_bias and allowed_token_ids: SamplingParams checks them, the sampler applies them per row (vLLM's
order: allowed tokens, then the bias, then penalties), and rows that do not set them are untouched."""

from __future__ import annotations

import pytest
import torch

from fitserve.core.sampling_params import SamplingParams
from fitserve.worker.logits_processors import apply_allowed_token_ids, apply_logit_bias
from fitserve.worker.sampler import Sampler, SamplingRow

VOCAB = 64
sampler = Sampler()


def row(params: SamplingParams, output: list[int] | None = None) -> SamplingRow:
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, [0], output or [], generator, frozenset())


def random_logits(batch: int, seed: int) -> torch.Tensor:
    return torch.randn((batch, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3


def test_params_store_int_keys_and_sorted_unique_ids() -> None:
    params = SamplingParams(logit_bias={"5": 2.5, 7: -1}, allowed_token_ids=[9, 3, 9])
    assert params.logit_bias == {5: 2.5, 7: -1.0}
    assert params.allowed_token_ids == [3, 9]
    assert SamplingParams(logit_bias={}).logit_bias is None  # empty = off: the fast path stays


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {"abc": 1.0}}, "logit_bias has the key 'abc'"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias has the key -1"),
        ({"logit_bias": {3: "high"}}, "logit_bias[3]='high' is not a number"),
        ({"logit_bias": [1, 2]}, "set logit_bias to a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids contains -2"),
        ({"allowed_token_ids": 5}, "set allowed_token_ids to a list"),
    ],
)
def test_bad_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_refused() -> None:
    SamplingParams(logit_bias={63: 1.0}, allowed_token_ids=[63]).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match=r"logit_bias holds token id 64, outside the vocabulary \[0, 64\)"):
        SamplingParams(logit_bias={64: 1.0}).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match="allowed_token_ids holds token id 100"):
        SamplingParams(allowed_token_ids=[1, 100]).check_token_ids(VOCAB)


def test_bias_is_added_to_the_logits_of_its_row_only() -> None:
    logits = random_logits(3, seed=1)
    expected = logits.clone()
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={4: 10.0, 9: -2.5})),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logit_bias={4: 1.0})),
    ]
    apply_logit_bias(logits, rows)
    expected[0, 4] += 10.0
    expected[0, 9] -= 2.5
    expected[2, 4] += 1.0
    assert torch.equal(logits, expected)


def test_allowed_token_ids_mask_every_other_token() -> None:
    logits = random_logits(2, seed=2)
    before = logits.clone()
    apply_allowed_token_ids(logits, [row(SamplingParams(allowed_token_ids=[3, 40])), row(SamplingParams())])
    assert torch.equal(logits[1], before[1])
    kept = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert kept == [3, 40]
    assert torch.equal(logits[0, [3, 40]], before[0, [3, 40]])


def test_a_large_bias_decides_greedy_and_random_sampling() -> None:
    logits = random_logits(4, seed=3)
    target = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=0.8, top_p=0.9, logit_bias={target: 100.0}, seed=5),
        SamplingParams(temperature=0.0),
    ]
    logits[:3] = logits[0]
    out = sampler(logits, [row(p) for p in params])
    assert out.sampled_token_ids[:3] == [target] * 3
    assert out.sampled_token_ids[3] == int(logits[3].argmax())


def test_a_large_negative_bias_bans_the_greedy_choice() -> None:
    logits = random_logits(1, seed=4)
    best = int(logits[0].argmax())
    second = int(logits[0].topk(2).indices[1])
    out = sampler(logits, [row(SamplingParams(temperature=0.0, logit_bias={best: -100.0}))])
    assert out.sampled_token_ids == [second]


def test_random_sampling_stays_inside_allowed_token_ids() -> None:
    logits = random_logits(256, seed=5)
    allowed = [2, 17, 33]
    out = sampler(
        logits, [row(SamplingParams(temperature=1.5, allowed_token_ids=allowed)) for _ in range(256)]
    )
    assert set(out.sampled_token_ids) <= set(allowed)
    assert len(set(out.sampled_token_ids)) > 1  # still a draw among them, not argmax


def test_allowed_then_bias_then_penalties() -> None:
    """vLLM's order: the bias is added before the repetition penalty divides a positive logit."""
    logits = torch.zeros((1, VOCAB))
    logits[0, 5] = 2.0
    logits[0, 6] = 2.9
    params = SamplingParams(
        temperature=0.0, logit_bias={5: 2.0}, repetition_penalty=2.0, allowed_token_ids=[5, 6]
    )
    # token 5 is in the output: (2 + 2) / 2 = 2.0 < 2.9, so token 6 wins; biasing after the penalty
    # would give 2 / 2 + 2 = 3.0 and pick token 5.
    out = sampler(logits, [row(params, output=[5])])
    assert out.sampled_token_ids == [6]


def test_logprobs_stay_the_raw_ones_and_callers_logits_are_untouched() -> None:
    logits = random_logits(1, seed=6)
    before = logits.clone()
    params = SamplingParams(temperature=0.0, logit_bias={1: 50.0}, allowed_token_ids=[1, 2], logprobs=1)
    out = sampler(logits, [row(params)])
    assert torch.equal(logits, before)
    assert out.sampled_token_ids == [1]
    raw = torch.log_softmax(before[0], dim=-1)
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprobs[0] == pytest.approx(float(raw[1]), abs=1e-5)
