"""CPU cost of one per-token metrics observation in `fitserve serve`: a labelled histogram series looked
up per call (`histogram.labels(model).observe(x)`, as fitserve.server.metrics did) against the series
looked up once (`series.observe(x)`, as it does now). The inter-token-latency histogram takes one
observation per generated token. Best of --repeats runs of --calls calls each, wall time.

Usage: python benchmarks/metrics_observe.py [--out benchmarks/results/cpu_metrics_observe.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import timeit

from prometheus_client import CollectorRegistry, Histogram


def best_us_per_call(call, calls: int, repeats: int) -> float:
    return min(timeit.repeat(call, number=calls, repeat=repeats)) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.calls < 1 or args.repeats < 1:
        raise SystemExit(f"--calls {args.calls} and --repeats {args.repeats} must be at least 1")
    histogram = Histogram("itl", "inter-token latency", ["model_name"], registry=CollectorRegistry())
    series = histogram.labels("model")
    figures = {
        "labels_then_observe_us": best_us_per_call(
            lambda: histogram.labels("model").observe(0.01), args.calls, args.repeats
        ),
        "cached_series_observe_us": best_us_per_call(lambda: series.observe(0.01), args.calls, args.repeats),
    }
    result = {
        "workload": "metrics_observe",
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "python": platform.python_version(),
            "prometheus_client": importlib.metadata.version("prometheus_client"),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
        "figures": {name: round(value, 3) for name, value in figures.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
