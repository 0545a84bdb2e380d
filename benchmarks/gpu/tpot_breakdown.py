"""Where a `bench serve` run's TPOT went: steps of decode only against steps with prompt tokens.

Takes the server's step trace (bench_serve_gpu.py --step-trace, benchmarks/gpu/step_trace/) and the
bench serve result saved with --save-detailed (per-request start times, TTFTs and latencies; the
client and the server read the same monotonic clock on one machine). Each step lasts until the next
launch. For every request, the steps between its first and last token are split into those without
prompt tokens and those with; their time over (output tokens - 1) are the two parts of its TPOT.
Of the decode part, it also reports what the slow decode steps (over 1.2 x the median) took beyond
the median: time the device or the host stalled.
Prints one JSON object: the run's figures, the median pure decode step at the largest batch, the
steps with prompt tokens by size, the mean of each TPOT part and the TTFT of the first wave.

  python benchmarks/gpu/tpot_breakdown.py STEP_TRACE RESULT_JSON [--wave 32]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

SLOW = 1.2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("result")
    parser.add_argument("--wave", type=int, default=32, help="requests that start together (concurrency)")
    args = parser.parse_args()
    with open(args.trace) as trace:
        steps = [line.split() for line in trace]
    launched = [float(step[0]) for step in steps]
    decode = [int(step[1]) for step in steps]
    prompt = [int(step[2]) for step in steps]
    seconds = [launched[i + 1] - launched[i] for i in range(len(steps) - 1)]
    with open(args.result) as result_file:
        result = json.load(result_file)
    starts, ttfts = result["start_times"], result["ttfts"]
    latencies, output_lens = result["latencies"], result["output_lens"]
    begin = min(starts)
    end = max(start + latency for start, latency in zip(starts, latencies))
    in_run = [i for i in range(len(seconds)) if begin <= launched[i] <= end]
    widest = max(decode[i] for i in in_run)
    pure = [seconds[i] * 1e3 for i in in_run if prompt[i] == 0 and decode[i] == widest]
    with_prompt: dict[int, list[float]] = collections.defaultdict(list)
    for i in in_run:
        if prompt[i]:
            with_prompt[prompt[i] // 64 * 64].append(seconds[i] * 1e3)
    # A decode step over SLOW x the median at the widest batch is slow: what it took beyond that median
    # is the decode part's excess (host stalls, or the device pausing: benchmarks/gpu/gpu_pauses.py).
    median_s = statistics.median(pure) / 1e3
    slow_above_s = median_s * SLOW
    pure_parts, prompt_parts, slow_parts = [], [], []
    for start, ttft, latency, outputs in zip(starts, ttfts, latencies, output_lens):
        mine = [i for i in in_run if start + ttft <= launched[i] < start + latency]
        pure_parts.append(sum(seconds[i] for i in mine if not prompt[i]) / (outputs - 1) * 1e3)
        prompt_parts.append(sum(seconds[i] for i in mine if prompt[i]) / (outputs - 1) * 1e3)
        slow_s = sum(seconds[i] - median_s for i in mine if not prompt[i] and seconds[i] > slow_above_s)
        slow_parts.append(slow_s / (outputs - 1) * 1e3)
    slow_steps = [i for i in in_run if not prompt[i] and seconds[i] > slow_above_s]
    by_start = [ttft for _, ttft in sorted(zip(starts, ttfts))]
    figures = {key: round(result[key], 2) for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")}
    figures |= {
        f"pure_decode_step_ms_at_batch_{widest}": round(median_s * 1e3, 3),
        "steps_with_prompt_tokens": {
            f"{size}-{size + 63} tokens": {"steps": len(v), "median_ms": round(statistics.median(v), 2)}
            for size, v in sorted(with_prompt.items())
        },
        "tpot_part_decode_steps_ms": round(statistics.mean(pure_parts), 3),
        "tpot_part_steps_with_prompt_tokens_ms": round(statistics.mean(prompt_parts), 3),
        "slow_decode_steps": len(slow_steps),
        "tpot_part_decode_steps_beyond_the_median_ms": round(statistics.mean(slow_parts), 3),
        "ttft_first_wave_mean_ms": round(statistics.mean(by_start[: args.wave]) * 1e3, 1),
        "ttft_later_mean_ms": round(statistics.mean(by_start[args.wave :] or [0.0]) * 1e3, 1),
    }
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
