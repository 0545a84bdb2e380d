"""Prometheus metrics at /metrics: vLLM's metric names under the `fitserve:` prefix.

Engine-wide gauges and counters (`num_requests_running`, `kv_cache_usage_perc`, `prompt_tokens_total`,
prefix-cache hits and queries, ...) are read from the engine's latest `EngineStats` at scrape time;
per-request histograms (TTFT, inter-token latency, end-to-end latency, ...) are observed as the
request's outputs arrive. Every series carries a `model_name` label. Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fitserve.core.outputs import RequestOutput

PREFIX = "fitserve:"
_LATENCY_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# (metric name without prefix, EngineStats attribute, help text)
_ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Number of requests running on the engine."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting to be scheduled."),
    (
        "kv_cache_usage_perc",
        "kv_cache_usage",
        "Fraction of KV cache blocks held by live requests (1 = 100%).",
    ),
)
_ENGINE_COUNTERS = (
    ("prompt_tokens", "num_prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "num_generation_tokens_total", "Number of generation tokens processed."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Number of requests preempted (recomputed later)."),
)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, read_stats: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        for name, attribute, documentation in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=["model_name"])
            gauge.add_metric([self.model_name], float(getattr(stats, attribute, 0) or 0) if stats else 0.0)
            yield gauge
        for name, attribute, documentation in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, documentation, labels=["model_name"])
            counter.add_metric([self.model_name], float(getattr(stats, attribute, 0) or 0) if stats else 0.0)
            yield counter


@dataclass
class _RequestProgress:
    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str, read_stats: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            """The histogram's one labelled series, looked up once: `.labels(...)` per observation (a lock
            and a dict, once per generated token for the inter-token latency) made one cost about twice
            as much (docs/performance.md, section "On the CPU")."""
            parent = Histogram(PREFIX + name, documentation, labels, buckets=buckets, registry=self.registry)
            return parent.labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two generated tokens of a request.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the request's end.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time a request waited before first being scheduled.",
            _LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens of finished requests (all n choices).",
            _TOKEN_BUCKETS,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(model_name, read_stats))
        self._progress: dict[str, _RequestProgress] = {}

    def observe(self, output: RequestOutput) -> None:
        """Called with every output the engine delivers for a request (cumulative, in order)."""
        timing = output.metrics
        progress = self._progress.get(output.request_id)
        if progress is None:
            arrival = timing.arrival_time if timing is not None else time.time()
            progress = self._progress[output.request_id] = _RequestProgress(arrival_time=arrival)
        num_tokens = max((len(choice.token_ids) for choice in output.outputs), default=0)
        if num_tokens > progress.num_tokens:
            token_time = timing.last_token_time if timing and timing.last_token_time else time.time()
            if progress.last_token_time is None:
                first = timing.first_token_time if timing and timing.first_token_time else token_time
                self.time_to_first_token.observe(max(0.0, first - progress.arrival_time))
            else:
                gap = max(0.0, token_time - progress.last_token_time) / (num_tokens - progress.num_tokens)
                for _ in range(num_tokens - progress.num_tokens):
                    self.inter_token_latency.observe(gap)
            progress.num_tokens, progress.last_token_time = num_tokens, token_time
        if output.finished:
            self._finish(output, progress)

    def _finish(self, output: RequestOutput, progress: _RequestProgress) -> None:
        del self._progress[output.request_id]
        timing = output.metrics
        finished_time = timing.finished_time if timing and timing.finished_time else time.time()
        self.e2e_request_latency.observe(max(0.0, finished_time - progress.arrival_time))
        if timing is not None and timing.first_scheduled_time is not None:
            queued = max(0.0, timing.first_scheduled_time - progress.arrival_time)
            self.request_queue_time.observe(queued)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        generated = sum(len(choice.token_ids) for choice in output.outputs)
        self.request_generation_tokens.observe(generated)
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "abort")
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
