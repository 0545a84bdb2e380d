"""`bench serve --plot`: one PNG with the TTFT and E2EL distributions and output tokens/s over time.

matplotlib is imported only here and only when a plot is asked for; it is an optional dependency
(`pip install matplotlib`, or the `bench` extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitserve.bench.client import RequestResult
from fitserve.bench.metrics import BenchmarkMetrics

HISTOGRAM_BINS = 30


def import_pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: run `pip install matplotlib`"
        ) from None
    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_serve_results(results: Sequence[RequestResult], metrics: BenchmarkMetrics, path: Path) -> Path:
    pyplot = import_pyplot()
    succeeded = [result for result in results if result.success]
    ttfts_ms = [result.ttft * 1000 for result in succeeded]
    e2els_ms = [result.latency * 1000 for result in succeeded]
    figure, (ttft_axes, e2el_axes, rate_axes) = pyplot.subplots(1, 3, figsize=(16, 4.5))
    figure.suptitle(
        f"{metrics.completed} requests ({metrics.failed} failed), "
        f"{metrics.output_throughput:.1f} output tok/s over {metrics.duration:.1f} s"
    )
    for axes, values, name, mean in (
        (ttft_axes, ttfts_ms, "TTFT", metrics.ttft_ms.mean),
        (e2el_axes, e2els_ms, "E2EL", metrics.e2el_ms.mean),
    ):
        axes.hist(values, bins=HISTOGRAM_BINS, color="tab:blue", alpha=0.8)
        axes.axvline(mean, color="tab:red", linestyle="--", label=f"mean {mean:.1f} ms")
        axes.set_title(f"{name} distribution")
        axes.set_xlabel(f"{name} (ms)")
        axes.set_ylabel("requests")
        axes.legend()
    per_second = list(metrics.output_tokens_per_second)
    rate_axes.step(range(len(per_second)), per_second, where="post", color="tab:green")
    rate_axes.set_title("Output tokens per second")
    rate_axes.set_xlabel("seconds since the first request")
    rate_axes.set_ylabel("tokens/s")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
