"""Does the GPU itself pause now and then? A loop of memory-bound matrix products (32 rows times 30
weights of 8192 x 8192 in bf16: 4 GB read, ~1.45 ms on an H100), each iteration timed on the device
with CUDA events, with at most two iterations queued. No server, no Python work between iterations:
an iteration much slower than the median is the device (driver, power management), not fitserve.

Prints and saves the iteration times, the slow iterations (over 1.2 x the median), how they cluster
in time and the share of the run they cost. benchmarks/gpu/tpot_breakdown.py reports the same kind of
excess for a serving run's decode steps.

  python benchmarks/gpu/gpu_pauses.py [--iterations 8000] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import save  # noqa: I001

ROWS, SIZE, WEIGHTS = 32, 8192, 30
SLOW = 1.2  # an iteration over this many times the median is slow
CLUSTER_GAP_S = 0.3  # slow iterations closer than this belong to one pause


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=8000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.iterations < 100:
        parser.error(
            f"--iterations {args.iterations} is below 100: a pause comes every second or two, so time at "
            "least a few seconds (the default 8000 is ~12 s on an H100)"
        )
    x = torch.randn(ROWS, SIZE, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHTS)]

    def iteration() -> None:
        for weight in weights:
            torch.mm(x, weight)

    for _ in range(20):
        iteration()
    torch.cuda.synchronize()
    events, launched = [], []
    start = time.perf_counter()
    for i in range(args.iterations):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        iteration()
        end.record()
        events.append((begin, end))
        launched.append(time.perf_counter() - start)
        if i >= 2:
            events[i - 2][1].synchronize()
    torch.cuda.synchronize()
    # Start to start: an iteration's own time plus any wait before the next one began.
    spans = [events[i][0].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1)]
    median = statistics.median(spans)
    slow = [i for i, span in enumerate(spans) if span > SLOW * median]
    pauses: list[list[int]] = []
    for i in slow:
        if pauses and launched[i] - launched[pauses[-1][-1]] <= CLUSTER_GAP_S:
            pauses[-1].append(i)
        else:
            pauses.append([i])
    starts = [round(launched[p[0]], 2) for p in pauses]
    excess = sum(spans[i] - median for i in slow)
    save(
        "gpu_pauses",
        {
            "iterations": len(spans),
            "run_s": round(sum(spans) / 1e3, 2),
            "median_iteration_ms": round(median, 3),
            "max_iteration_ms": round(max(spans), 3),
            "slow_iterations": len(slow),
            "slow_excess_ms": round(excess, 1),
            "slow_excess_share_of_run": round(excess / sum(spans), 4),
            "pauses_start_s": starts,
            "seconds_between_pauses": [round(b - a, 2) for a, b in zip(starts, starts[1:])],
            "pause_excess_ms": [round(sum(spans[i] - median for i in p), 1) for p in pauses],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
