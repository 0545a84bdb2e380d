"""bench serve metric arithmetic on a recorded set of timestamps, against hand-computed values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from fitserve.bench.metrics import (
    RequestTiming,
    compute_metrics,
    peak_concurrency,
    percentile,
    percentile_key,
    std,
    time_per_output_token,
)

# Three successful requests (seconds); one more request failed. Benchmark duration 2 s.
#   A: sent 0.0, first token +0.1, gaps 0.05 0.05 0.1 -> last token +0.3, 4 tokens, 10 prompt tokens
#   B: sent 0.2, first token +0.2, gap 0.1            -> last token +0.3, 2 tokens, 20 prompt tokens
#   C: sent 1.0, first token +0.4, no gap             -> last token +0.4, 1 token,   5 prompt tokens
RECORDED = [
    RequestTiming(
        prompt_len=10, output_tokens=4, ttft=0.1, itl=(0.05, 0.05, 0.1), latency=0.3, start_time=0.0
    ),
    RequestTiming(prompt_len=20, output_tokens=2, ttft=0.2, itl=(0.1,), latency=0.3, start_time=0.2),
    RequestTiming(prompt_len=5, output_tokens=1, ttft=0.4, itl=(), latency=0.4, start_time=1.0),
]


@pytest.fixture(scope="module")
def metrics():
    return compute_metrics(RECORDED, failed=1, duration=2.0, percents=[50, 90, 99])


def test_counts_and_throughputs(metrics):
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.total_input, metrics.total_output) == (35, 7)
    assert metrics.request_throughput == pytest.approx(1.5)  # 3 requests / 2 s
    assert metrics.output_throughput == pytest.approx(3.5)  # 7 tokens / 2 s
    assert metrics.total_token_throughput == pytest.approx(21.0)  # (35 + 7) / 2 s


def test_ttft(metrics):
    # [100, 200, 400] ms
    assert metrics.ttft_ms.mean == pytest.approx(700 / 3)
    assert metrics.ttft_ms.median == pytest.approx(200)
    assert metrics.ttft_ms.std == pytest.approx(
        math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3)
    )
    assert metrics.ttft_ms.percentiles[99] == pytest.approx(396)  # rank 1.98: 200 + 0.98 * 200
    assert metrics.ttft_ms.percentiles[90] == pytest.approx(360)  # rank 1.8: 200 + 0.8 * 200


def test_tpot_leaves_out_single_token_requests(metrics):
    # A: (0.3 - 0.1) / 3 = 66.67 ms, B: (0.3 - 0.2) / 1 = 100 ms, C has one token: no TPOT
    assert time_per_output_token(RECORDED[2]) is None
    assert metrics.tpot_ms.mean == pytest.approx((200 / 3 + 100) / 2)
    assert metrics.tpot_ms.median == pytest.approx((200 / 3 + 100) / 2)
    assert metrics.tpot_ms.percentiles[99] == pytest.approx(200 / 3 + 0.99 * (100 - 200 / 3))


def test_itl_pools_every_gap(metrics):
    # [50, 50, 100, 100] ms
    assert metrics.itl_ms.mean == pytest.approx(75)
    assert metrics.itl_ms.median == pytest.approx(75)
    assert metrics.itl_ms.std == pytest.approx(25)
    assert metrics.itl_ms.percentiles[99] == pytest.approx(100)


def test_e2el(metrics):
    # [300, 300, 400] ms
    assert metrics.e2el_ms.mean == pytest.approx(1000 / 3)
    assert metrics.e2el_ms.median == pytest.approx(300)
    assert metrics.e2el_ms.percentiles[99] == pytest.approx(398)


def test_tokens_per_second_buckets_and_peaks(metrics):
    # Token arrivals: A 0.1 0.15 0.2 0.3, B 0.4 0.5, C 1.4 -> buckets [0, 1): 6, [1, 2): 1, [2, 3): 0
    assert metrics.output_tokens_per_second == (6, 1, 0)
    assert metrics.max_output_tokens_per_s == 6
    assert metrics.max_concurrent_requests == 2  # A [0, 0.3) overlaps B [0.2, 0.5)


def test_a_request_ending_as_another_starts_does_not_overlap():
    back_to_back = [
        RequestTiming(1, 1, 0.5, (), 1.0, start_time=0.0),
        RequestTiming(1, 1, 0.5, (), 1.0, start_time=1.0),
    ]
    assert peak_concurrency(back_to_back) == 1


def test_no_successful_request_reports_zeros():
    empty = compute_metrics([], failed=4, duration=1.0, percents=[99])
    assert (empty.completed, empty.failed, empty.total_output) == (0, 4, 0)
    assert empty.ttft_ms.mean == empty.ttft_ms.percentiles[99] == empty.e2el_ms.median == 0.0
    assert empty.output_tokens_per_second == ()


def test_statistics_match_numpy_definitions():
    rng = random.Random(5)
    values = [rng.uniform(0, 10) for _ in range(37)]
    for percent in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, percent) == pytest.approx(float(np.percentile(values, percent)))
    assert std(values) == pytest.approx(float(np.std(values)))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="outside \\[0, 100\\]"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="duration 0 s is not above 0"):
        compute_metrics(RECORDED, failed=0, duration=0, percents=[99])


def test_percentile_key_spelling():
    assert [percentile_key(p) for p in (99, 99.0, 99.9, 50)] == ["99", "99", "99.9", "50"]
