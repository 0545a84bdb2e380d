"""Where a `bench serve` run's TPOT went: steps of decode only against steps with prompt tokens.

Takes the server's step trace (bench_serve_gpu.py --step-trace, benchmarks/gpu/step_trace/) and the
bench serve result saved with --save-detailed (per-request start times, TTFTs and latencies; the
client and the server read the same monotonic clock on one machine). Each step lasts until the next
launch. For every request, the steps between its first and last token are split into those without
prompt tokens and those with; their time over (output tokens - 1) are the two parts of its TPOT.

Of the decode part, it also reports the time above the median decode step at the widest batch (what
each such step took beyond the median, netted over the request's steps: a launch that comes late and
the next one early cancel out), and the count of slow steps (over 1.2 x the median). When the trace
has the device columns (each step's time on the device, and the device's idle time before it), the
same figures from the device's clock, and the idle time per token: together they tell a device that
paused (benchmarks/gpu/gpu_pauses.py) from a host that came late.

Prints one JSON object: the run's figures, the median pure decode step at the largest batch, the
steps with prompt tokens by size, the mean of each TPOT part and the TTFT of the first wave.

  python benchmarks/gpu/tpot_breakdown.py STEP_TRACE RESULT_JSON [--wave 32] [--timeline 2]

--timeline S adds the run in intervals of S seconds (requests started and finished, steps, decode rows,
prompt tokens, device time); with STEP_TRACE '-' it gives the client's side alone, for a server without a
trace (vLLM), so two servers' runs of the same client can be laid side by side.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

SLOW = 1.2


def read_trace(path: str) -> list[list[str]]:
    with open(path) as trace:
        return [line.split() for line in trace if line.strip()]


def breakdown(steps: list[list[str]], result: dict, wave: int) -> dict:
    """The figures for a step trace (rows of its columns as strings) and a detailed bench serve result."""
    launched = [float(step[0]) for step in steps]
    decode = [int(step[1]) for step in steps]
    prompt = [int(step[2]) for step in steps]
    has_device = all(len(step) >= 6 for step in steps)
    seconds = [launched[i + 1] - launched[i] for i in range(len(steps) - 1)]
    starts, ttfts = result["start_times"], result["ttfts"]
    latencies, output_lens = result["latencies"], result["output_lens"]
    begin = min(starts)
    end = max(start + latency for start, latency in zip(starts, latencies))
    in_run = [i for i in range(len(seconds)) if begin <= launched[i] <= end]
    widest = max(decode[i] for i in in_run)
    widest_pure = [i for i in in_run if prompt[i] == 0 and decode[i] == widest]
    with_prompt: dict[int, list[float]] = collections.defaultdict(list)
    for i in in_run:
        if prompt[i]:
            with_prompt[prompt[i] // 64 * 64].append(seconds[i] * 1e3)
    median_s = statistics.median(seconds[i] for i in widest_pure)
    device_s = [float(step[4]) / 1e3 for step in steps] if has_device else []
    idle_s = [float(step[5]) / 1e3 for step in steps] if has_device else []
    device_median_s = statistics.median(device_s[i] for i in widest_pure) if has_device else 0.0
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for start, ttft, latency, outputs in zip(starts, ttfts, latencies, output_lens):
        mine = [i for i in in_run if start + ttft <= launched[i] < start + latency]
        mine_widest = [i for i in mine if prompt[i] == 0 and decode[i] == widest]
        # a step lasts until the next launch, or until this request's last token: alone on the server
        # (concurrency 1) its last step would otherwise run on until the next request's first launch
        lasted = {i: min(seconds[i], start + latency - launched[i]) for i in mine}
        per_token = 1e3 / (outputs - 1)
        parts["decode"].append(sum(lasted[i] for i in mine if not prompt[i]) * per_token)
        parts["prompt"].append(sum(lasted[i] for i in mine if prompt[i]) * per_token)
        parts["above"].append(sum(lasted[i] - median_s for i in mine_widest) * per_token)
        if has_device:
            parts["device_above"].append(sum(device_s[i] - device_median_s for i in mine_widest) * per_token)
            parts["device_idle"].append(sum(idle_s[i] for i in mine) * per_token)
    figures = {key: round(result[key], 2) for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")}
    figures |= {
        f"pure_decode_step_ms_at_batch_{widest}": round(median_s * 1e3, 3),
        "steps_with_prompt_tokens": {
            f"{size}-{size + 63} tokens": {"steps": len(v), "median_ms": round(statistics.median(v), 2)}
            for size, v in sorted(with_prompt.items())
        },
        "tpot_part_decode_steps_ms": round(statistics.mean(parts["decode"]), 3),
        "tpot_part_steps_with_prompt_tokens_ms": round(statistics.mean(parts["prompt"]), 3),
        "slow_decode_steps": sum(1 for i in widest_pure if seconds[i] > SLOW * median_s),
        "tpot_part_above_the_median_decode_step_ms": round(statistics.mean(parts["above"]), 3),
    }
    if has_device:
        figures["device"] = {
            f"median_decode_step_ms_at_batch_{widest}": round(device_median_s * 1e3, 3),
            "slow_decode_steps": sum(1 for i in widest_pure if device_s[i] > SLOW * device_median_s),
            "tpot_part_above_the_median_decode_step_ms": round(statistics.mean(parts["device_above"]), 3),
            "tpot_part_idle_ms": round(statistics.mean(parts["device_idle"]), 3),
        }
    by_start = [ttft for _, ttft in sorted(zip(starts, ttfts))]
    figures["ttft_first_wave_mean_ms"] = round(statistics.mean(by_start[:wave]) * 1e3, 1)
    figures["ttft_later_mean_ms"] = round(statistics.mean(by_start[wave:] or [0.0]) * 1e3, 1)
    return figures


def timeline(steps: list[list[str]], result: dict, seconds: float) -> list[dict]:
    """The run in intervals of `seconds` from its first request: requests started and finished (from the
    client's result, so it works for any server's), and from the step trace (empty for a server without
    one) the steps launched, those without prompt tokens, their mean decode rows, the prompt tokens
    scheduled and, with device columns, the device's milliseconds. A closed-loop client whose requests
    start together shows phases: bursts of prompts, then decode-only steps while the wave drains."""
    starts = result["start_times"]
    ends = [start + latency for start, latency in zip(starts, result["latencies"])]
    begin = min(starts)
    count = int((max(ends) - begin) // seconds) + 1
    rows = [
        {"from_s": round(i * seconds, 3), "started": 0, "finished": 0, "steps": 0, "decode_only_steps": 0}
        for i in range(count)
    ]
    decode_rows = [0] * count
    prompt_tokens = [0] * count
    device_ms = [0.0] * count
    for start, end in zip(starts, ends):
        rows[int((start - begin) // seconds)]["started"] += 1
        rows[int((end - begin) // seconds)]["finished"] += 1
    for step in steps:
        at = int((float(step[0]) - begin) // seconds)
        if not 0 <= at < count:
            continue
        rows[at]["steps"] += 1
        rows[at]["decode_only_steps"] += int(step[2]) == 0
        decode_rows[at] += int(step[1])
        prompt_tokens[at] += int(step[2])
        if len(step) >= 6:
            device_ms[at] += float(step[4])
    for i, row in enumerate(rows):
        if steps:
            row["mean_decode_rows"] = round(decode_rows[i] / row["steps"], 1) if row["steps"] else 0.0
            row["prompt_tokens"] = prompt_tokens[i]
        if steps and all(len(step) >= 6 for step in steps):
            row["device_ms"] = round(device_ms[i], 1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", help="the server's step trace ('-' for a server without one)")
    parser.add_argument("result")
    parser.add_argument("--wave", type=int, default=32, help="requests that start together (concurrency)")
    parser.add_argument("--timeline", type=float, default=None, help="also the run in intervals of S s")
    args = parser.parse_args()
    with open(args.result) as result_file:
        result = json.load(result_file)
    steps = read_trace(args.trace) if args.trace != "-" else []
    figures = breakdown(steps, result, args.wave) if steps else {}
    if args.timeline:
        figures["timeline"] = timeline(steps, result, args.timeline)
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
