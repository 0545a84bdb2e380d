"""The `bench serve` summary table and result JSON, in `vllm bench serve`'s layout and key names.

The JSON always carries mean / median / std / percentile keys for all four metrics (ttft, tpot, itl,
e2el), a superset of vLLM's, so a script reading vLLM's keys reads fitserve's; --percentile-metrics only
chooses what the table shows. Extra keys: `command`, `server_version` (the server's /version, null when
it has none) and `failures` (failed requests by kind).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitserve.bench.client import FAILURE_KINDS, RequestResult
from fitserve.bench.metrics import METRIC_NAMES, BenchmarkMetrics, percentile_key

if TYPE_CHECKING:
    from fitserve.bench.serve import ServerInfo

TABLE_WIDTH = 50
METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# Per-request lists, saved only with --save-detailed (as vLLM does).
DETAILED_KEYS = (
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "generated_texts",
    "errors",
    "output_tokens_per_second_timeline",
)
FAILURES_SHOWN = 10


def format_summary(
    metrics: BenchmarkMetrics, shown_metrics: Sequence[str], max_concurrency: int | None, request_rate: float
) -> str:
    lines = [f"{' Serving Benchmark Result ':=^{TABLE_WIDTH}}"]

    def row(label: str, value: Any, decimals: bool = True) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}")

    row("Successful requests:", metrics.completed, decimals=False)
    row("Failed requests:", metrics.failed, decimals=False)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency, decimals=False)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", metrics.duration)
    row("Total input tokens:", metrics.total_input, decimals=False)
    row("Total generated tokens:", metrics.total_output, decimals=False)
    row("Request throughput (req/s):", metrics.request_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
    row("Peak concurrent requests:", metrics.max_concurrent_requests)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    for metric in METRIC_NAMES:
        if metric not in shown_metrics:
            continue
        short, header = METRIC_HEADERS[metric]
        stats = metrics.distribution(metric)
        lines.append(f"{header:-^{TABLE_WIDTH}}")
        row(f"Mean {short} (ms):", stats.mean)
        row(f"Median {short} (ms):", stats.median)
        for percent, value in stats.percentiles.items():
            row(f"P{percentile_key(percent)} {short} (ms):", value)
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


def print_summary(
    metrics: BenchmarkMetrics, shown_metrics: Sequence[str], max_concurrency: int | None, request_rate: float
) -> None:
    print(format_summary(metrics, shown_metrics, max_concurrency, request_rate))


def failure_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    counts = Counter(result.failure_kind for result in results if not result.success)
    return {kind: counts[kind] for kind in FAILURE_KINDS if counts[kind]}


def print_failures(results: Sequence[RequestResult]) -> None:
    failed = [result for result in results if not result.success]
    if not failed:
        return
    kinds = ", ".join(f"{kind} {count}" for kind, count in failure_counts(results).items())
    print(f"Failed requests: {len(failed)} ({kinds}); the first {min(len(failed), FAILURES_SHOWN)}:")
    for index, result in enumerate(failed[:FAILURES_SHOWN]):
        print(f"  {index}: [{result.failure_kind}] {result.error}")


def metric_keys(metrics: BenchmarkMetrics) -> dict[str, float]:
    keys: dict[str, float] = {}
    for metric in METRIC_NAMES:
        stats = metrics.distribution(metric)
        keys[f"mean_{metric}_ms"] = stats.mean
        keys[f"median_{metric}_ms"] = stats.median
        keys[f"std_{metric}_ms"] = stats.std
        for percent, value in stats.percentiles.items():
            keys[f"p{percentile_key(percent)}_{metric}_ms"] = value
    return keys


def build_result_json(
    args: argparse.Namespace,
    metrics: BenchmarkMetrics,
    results: Sequence[RequestResult],
    output_lens: Sequence[int],
    model_id: str,
    tokenizer_id: str,
    server: ServerInfo,
) -> dict[str, Any]:
    """Everything a run measured; DETAILED_KEYS are dropped when saving without --save-detailed."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "command": getattr(args, "command_line", None),
        "server_version": server.version,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "failures": failure_counts(results),
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        **metric_keys(metrics),
        "input_lens": [result.prompt_len for result in results],
        "output_lens": list(output_lens),
        "ttfts": [result.ttft for result in results],
        "itls": [result.itl for result in results],
        "latencies": [result.latency for result in results],
        "start_times": [result.start_time for result in results],
        "generated_texts": [result.generated_text for result in results],
        "errors": [result.error for result in results],
        "output_tokens_per_second_timeline": list(metrics.output_tokens_per_second),
    }


def result_file_path(args: argparse.Namespace, model_id: str, date: str) -> Path:
    """--result-dir / (--result-filename or vLLM's default name)."""
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = model_id.rstrip("/").split("/")[-1]
        name = f"{args.label or args.backend}-{float(args.request_rate)}qps{concurrency}-{model}-{date}.json"
    return Path(args.result_dir or ".") / name


def save_result_json(result: dict[str, Any], path: Path, detailed: bool) -> None:
    saved = result if detailed else {key: value for key, value in result.items() if key not in DETAILED_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
