"""The built-in offline workloads of `fitserve bench throughput` (the GPU issue's nano and equal)."""

from __future__ import annotations

import random

import pytest

from fitserve.bench.workloads import equal_workload, fixed_length_workload, named_workload, nano_workload


def test_nano_is_defined_by_one_seeded_stream():
    workload = nano_workload()
    assert len(workload.requests) == 256
    assert (workload.temperature, workload.max_model_len) == (0.6, 4096)
    input_lens = [len(r.prompt_token_ids) for r in workload.requests]
    output_lens = [r.max_tokens for r in workload.requests]
    assert all(100 <= n <= 1024 for n in input_lens + output_lens)
    assert all(0 <= t <= 10000 for r in workload.requests for t in r.prompt_token_ids)
    # the draw order of the definition: 256 input lengths, then 256 output lengths, then the ids
    rng = random.Random(0)
    assert input_lens == [rng.randint(100, 1024) for _ in range(256)]
    assert output_lens == [rng.randint(100, 1024) for _ in range(256)]
    assert workload.requests[0].prompt_token_ids[:3] == [rng.randint(0, 10000) for _ in range(3)]
    # pinned totals: a change to the definition shows up here
    assert (workload.num_prompt_tokens, workload.num_output_tokens) == (144831, 144160)
    assert workload.requests[0].prompt_token_ids[:5] == [1161, 4958, 6605, 5382, 4902]


def test_equal_is_256_greedy_requests_of_512_in_512_out():
    workload = equal_workload()
    assert len(workload.requests) == 256 and workload.temperature == 0.0
    assert {len(r.prompt_token_ids) for r in workload.requests} == {512}
    assert {r.max_tokens for r in workload.requests} == {512}
    assert workload.requests[0].prompt_token_ids[:5] == [6311, 6890, 663, 4242, 8376]
    assert equal_workload() == workload


def test_fixed_length_workload_fits_small_vocabularies():
    workload = fixed_length_workload(3, input_len=7, output_len=2, seed=1, vocab_size=50)
    assert [len(r.prompt_token_ids) for r in workload.requests] == [7, 7, 7]
    assert all(0 <= t < 50 for r in workload.requests for t in r.prompt_token_ids)
    assert workload.max_token_id == 49


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="workload='tiny' is not one of nano, equal"):
        named_workload("tiny")
