"""Prometheus metrics at /metrics, under vLLM's names: `vllm:` prefix, vLLM's types, buckets and labels
(`model_name`, the first served name, and `engine`, always "0"), so vLLM's Grafana dashboards and the
routers that read `vllm:num_requests_waiting` or `vllm:kv_cache_usage_perc` work unchanged. Metrics vLLM
has no name for would go under `fitserve:` (none today).

Engine-wide gauges, counters and the tokens-per-step histogram are read from the engine's latest
`EngineStats` at scrape time; per-request histograms (TTFT, inter-token latency, end-to-end latency, ...)
are observed as the request's outputs arrive. Each app has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from fitserve.core.outputs import RequestOutput
from fitserve.engine.engine import ITERATION_TOKENS_BUCKETS

PREFIX = "vllm:"
FITSERVE_PREFIX = "fitserve:"  # for metrics vLLM has no name for
ENGINE = "0"  # vLLM's `engine` label: the engine core's index; fitserve runs one
FINISHED_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
_TOKEN_GAP_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
_REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts, to max_model_len)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


# (metric name without prefix, EngineStats attribute, help text)
_ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)
_ENGINE_COUNTERS = (
    ("prompt_tokens", "num_prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "num_generation_tokens_total", "Number of generation tokens processed."),
    (
        "prefix_cache_queries",
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
)

_SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "spec_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Number of accepted tokens."),
)


def cache_config_info(engine: Any) -> dict[str, str]:
    """vLLM's `vllm:cache_config_info` labels: the cache settings, and the KV blocks the engine's memory
    plan allocated (`num_gpu_blocks`, on the CPU too). `engine` is the AsyncEngine."""
    cache = engine.config.cache
    plan = getattr(getattr(engine, "engine", None), "memory_plan", None)
    if plan is not None:
        num_blocks: Any = plan.num_kv_blocks
    else:
        stats = engine.get_stats()
        num_blocks = getattr(stats, "num_kv_blocks", None)
    values = {
        "block_size": cache.block_size,
        "cache_dtype": cache.kv_cache_dtype,
        "cpu_offload_gb": engine.config.model.cpu_offload_gb,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "num_cpu_blocks": None,
        "num_gpu_blocks": num_blocks,
        "num_gpu_blocks_override": cache.num_gpu_blocks_override,
        "swap_space": cache.swap_space,
    }
    return {name: str(value) for name, value in values.items()}


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, read_stats: Callable[[], Any]) -> None:
        self.labels = [model_name, ENGINE]
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        labelnames = ["model_name", "engine"]
        for name, attribute, documentation in _ENGINE_GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, documentation, labels=labelnames)
            gauge.add_metric(self.labels, float(getattr(stats, attribute, 0) or 0) if stats else 0.0)
            yield gauge
        for name, attribute, documentation in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, documentation, labels=labelnames)
            counter.add_metric(self.labels, float(getattr(stats, attribute, 0) or 0) if stats else 0.0)
            yield counter
        histogram = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels=labelnames,
        )
        counts = tuple(getattr(stats, "iteration_tokens_counts", ()) or ()) if stats else ()
        counts = counts or (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, map(float, ITERATION_TOKENS_BUCKETS)), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        total = float(getattr(stats, "iteration_tokens_sum", 0) or 0) if stats else 0.0
        histogram.add_metric(self.labels, buckets, total)
        yield histogram
        if stats is not None and getattr(stats, "spec_accepted_per_pos", ()):
            yield from self._spec_decode(stats, labelnames)

    def _spec_decode(self, stats: Any, labelnames: list[str]) -> Iterator[Metric]:
        """vLLM's speculative decoding counters, there only when --speculative-config is set."""
        for name, attribute, documentation in _SPEC_DECODE_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, documentation, labels=labelnames)
            counter.add_metric(self.labels, float(getattr(stats, attribute)))
            yield counter
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*labelnames, "position"],
        )
        for position, count in enumerate(stats.spec_accepted_per_pos):
            per_pos.add_metric([*self.labels, str(position)], float(count))
        yield per_pos


@dataclass
class _RequestProgress:
    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        read_stats: Callable[[], Any],
        *,
        max_model_len: int = 2048,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        token_buckets = buckets_1_2_5(max_model_len)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Any:
            """The histogram's one labelled series, looked up once: `.labels(...)` per observation (a lock
            and a dict, once per generated token for the inter-token latency) made one cost about twice
            as much (docs/performance.md, section "On the CPU")."""
            parent = Histogram(PREFIX + name, documentation, labels, buckets=buckets, registry=self.registry)
            return parent.labels(model_name, ENGINE)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TOKEN_GAP_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the inter-token latency, vLLM's older name).",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        request_success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {
            reason: request_success.labels(model_name, ENGINE, reason) for reason in FINISHED_REASONS
        }
        if cache_info is not None:
            info = Gauge(
                PREFIX + "cache_config_info",
                "Information of the LLMEngine CacheConfig",
                [*cache_info, "engine"],
                registry=self.registry,
            )
            info.labels(**cache_info, engine=ENGINE).set(1)
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
                    self.time_per_output_token.observe(gap)
            progress.num_tokens, progress.last_token_time = num_tokens, token_time
        if output.finished:
            self._finish(output, progress)

    def _finish(self, output: RequestOutput, progress: _RequestProgress) -> None:
        del self._progress[output.request_id]
        timing = output.metrics
        finished_time = timing.finished_time if timing and timing.finished_time else time.time()
        self.e2e_request_latency.observe(max(0.0, finished_time - progress.arrival_time))
        scheduled = timing.first_scheduled_time if timing is not None else None
        first_token = timing.first_token_time if timing is not None else None
        last_token = timing.last_token_time if timing is not None else None
        if scheduled is not None:
            self.request_queue_time.observe(max(0.0, scheduled - progress.arrival_time))
            if first_token is not None:
                self.request_prefill_time.observe(max(0.0, first_token - scheduled))
            if last_token is not None:
                self.request_inference_time.observe(max(0.0, last_token - scheduled))
        if first_token is not None and last_token is not None:
            self.request_decode_time.observe(max(0.0, last_token - first_token))
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        per_choice = [len(choice.token_ids) for choice in output.outputs]
        self.request_generation_tokens.observe(sum(per_choice))
        self.request_max_num_generation_tokens.observe(max(per_choice, default=0))
        self.request_params_n.observe(max(1, len(output.outputs)))
        if timing is not None and timing.max_tokens_param:
            self.request_params_max_tokens.observe(timing.max_tokens_param)
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "abort")
        series = self.request_success.get(reason)
        if series is None:  # a reason vLLM has no series for ("tool_calls" is chat's; the engine says stop)
            series = self.request_success["stop"]
        series.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
