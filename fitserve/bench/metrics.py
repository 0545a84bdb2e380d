"""Serving metrics from per-request timings, with `vllm bench serve`'s definitions. Pure arithmetic.

Per successful request (seconds, client clock):
  TTFT  = first token chunk - send
  E2EL  = last token chunk - send
  ITL   = gaps between consecutive token chunks (all requests' gaps pooled)
  TPOT  = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token
Statistics: mean, median, population std, and percentiles by linear interpolation between the closest
ranks (numpy's default); an empty list gives 0 for each, as vLLM reports it. Throughputs divide the
totals of successful requests by the whole benchmark's duration. Failed requests enter only `failed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestTiming:
    """What was measured for one successful request."""

    prompt_len: int
    output_tokens: int
    ttft: float
    itl: tuple[float, ...]
    latency: float  # E2EL
    start_time: float  # clock reading at send, same clock as the benchmark's start


@dataclass(frozen=True)
class Distribution:
    """One metric's statistics, in milliseconds; percentiles keyed by the percent asked."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_tokens_per_second: tuple[int, ...]  # token chunks received in each second since the first send

    def distribution(self, metric: str) -> Distribution:
        return getattr(self, f"{metric}_ms")


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: Sequence[float]) -> float:
    """Population standard deviation (divides by n), as numpy's default."""
    if not values:
        return 0.0
    center = mean(values)
    return math.sqrt(sum((value - center) ** 2 for value in values) / len(values))


def percentile(values: Sequence[float], percent: float) -> float:
    """Linear interpolation between the closest ranks: rank = percent / 100 * (n - 1)."""
    if not 0 <= percent <= 100:
        raise ValueError(f"percentile {percent} is outside [0, 100]: use a value such as 99")
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = percent / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def distribution_ms(values_s: Sequence[float], percents: Sequence[float]) -> Distribution:
    values_ms = [value * 1000 for value in values_s]
    return Distribution(
        mean=mean(values_ms),
        median=median(values_ms),
        std=std(values_ms),
        percentiles={percent: percentile(values_ms, percent) for percent in percents},
    )


def time_per_output_token(timing: RequestTiming) -> float | None:
    if timing.output_tokens <= 1:
        return None
    return (timing.latency - timing.ttft) / (timing.output_tokens - 1)


def output_tokens_per_second(timings: Sequence[RequestTiming]) -> list[int]:
    """Token chunks per one-second bucket, counted from the earliest send (vLLM's peak-throughput basis)."""
    if not timings:
        return []
    first_send = min(t.start_time for t in timings)
    last_end = max(t.start_time + t.latency for t in timings)
    buckets = [0] * (math.ceil(last_end - first_send) + 1)
    for timing in timings:
        arrival = timing.start_time + timing.ttft
        arrivals = [arrival]
        for gap in timing.itl:
            arrival += gap
            arrivals.append(arrival)
        for moment in arrivals:
            bucket = int(moment - first_send)
            if 0 <= bucket < len(buckets):
                buckets[bucket] += 1
    return buckets


def peak_concurrency(timings: Sequence[RequestTiming]) -> int:
    """Most requests in flight at one instant; intervals are [send, last token), an end before a start."""
    events = sorted([(t.start_time, 1) for t in timings] + [(t.start_time + t.latency, -1) for t in timings])
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    return peak


def compute_metrics(
    timings: Sequence[RequestTiming], failed: int, duration: float, percents: Sequence[float]
) -> BenchmarkMetrics:
    if duration <= 0:
        raise ValueError(f"benchmark duration {duration} s is not above 0: nothing can be measured")
    total_input = sum(t.prompt_len for t in timings)
    total_output = sum(t.output_tokens for t in timings)
    tpots = [tpot for t in timings if (tpot := time_per_output_token(t)) is not None]
    per_second = output_tokens_per_second(timings)
    return BenchmarkMetrics(
        completed=len(timings),
        failed=failed,
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(timings) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        ttft_ms=distribution_ms([t.ttft for t in timings], percents),
        tpot_ms=distribution_ms(tpots, percents),
        itl_ms=distribution_ms([gap for t in timings for gap in t.itl], percents),
        e2el_ms=distribution_ms([t.latency for t in timings], percents),
        max_output_tokens_per_s=float(max(per_second, default=0)),
        max_concurrent_requests=peak_concurrency(timings),
        output_tokens_per_second=tuple(per_second),
    )


def percentile_key(percent: float) -> str:
    """vLLM's spelling in key names: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(percent)) if int(percent) == percent else str(percent)
