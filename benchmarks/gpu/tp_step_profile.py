"""Where a tensor-parallel batch-1 decode step goes, on every rank: GPU kernels by kind, idle GPU time,
the spread of the all-reduce kernels (a rank that waits for another shows long ones), host time per step.

  python benchmarks/gpu/tp_step_profile.py [--model llama-3.1-8b] [--tp 2] [--out-dir DIR]

Two batch-1 requests (128 random prompt tokens, --tokens greedy tokens, 256): the first warms up, and
--steps steps of the second (from its 64th) run under torch.profiler on every rank.
The other ranks are spawned processes, which import this script again as `__mp_main__`: the wrap at
the bottom of this file then profiles their steps (ModelRunner.run_host_inputs) as rank 0's
(ModelRunner.launch). Each rank writes rank<N>.json (its summary) and rank<N>.trace.json.gz (a Chrome
trace) to --out-dir; rank 0 prints all summaries.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import time
from pathlib import Path

OUT_DIR_ENV = "FITSERVE_TP_PROFILE_DIR"
WINDOW_ENV = "FITSERVE_TP_PROFILE_WINDOW"  # "first_step,steps", for the spawned ranks

KINDS = (  # (kind, substrings of a kernel's name, lower case); the first match wins
    ("all_reduce", ("nccl", "all_reduce", "allreduce", "one_shot", "two_shot")),
    ("attention", ("attention", "attn", "flash")),
    ("norm", ("norm",)),
    ("gemm", ("gemm", "gemv", "matmul", "mma", "splitk", "cutlass", "nvjet", "sm90", "linear", "skinny")),
    ("sampling", ("sample", "argmax", "softmax", "topk", "top_k", "multinomial", "exponential")),
    ("rotary", ("rope", "rotary")),
    ("activation", ("silu", "gelu", "act")),
)


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lower for k in keys)), "other")


def summarize(trace: dict, steps: int, rank: int, host_ms: list[float], period_ms: list[float]) -> dict:
    kernels = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels.sort(key=lambda e: e["ts"])
    if not kernels:
        return {"rank": rank, "error": "no kernels in the trace"}
    start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
    busy, covered_to = 0.0, start
    gaps = []
    for e in kernels:  # the union of the kernels' intervals, and the gaps between them
        lo, hi = e["ts"], e["ts"] + e["dur"]
        if lo > covered_to:
            gaps.append(lo - covered_to)
        busy += max(0.0, hi - max(lo, covered_to))
        covered_to = max(covered_to, hi)
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        kind = kind_of(e["name"]) if e["cat"] == "kernel" else e["cat"]
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
        by_name.setdefault(e["name"][:90], []).append(e["dur"])
    reduce_us = sorted(e["dur"] for e in kernels if kind_of(e["name"]) == "all_reduce")
    top = sorted(by_name.items(), key=lambda item: sum(item[1]), reverse=True)[:25]

    def quantile(values: list[float], q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else 0.0

    return {
        "rank": rank,
        "steps": steps,
        "gpu_span_us_per_step": round((end - start) / steps, 1),
        "gpu_busy_us_per_step": round(busy / steps, 1),
        "gpu_idle_us_per_step": round((end - start - busy) / steps, 1),
        "idle_gaps_over_5us_per_step": round(sum(1 for g in gaps if g > 5) / steps, 1),
        "idle_in_gaps_over_5us_per_step": round(sum(g for g in gaps if g > 5) / steps, 1),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "us_per_step_by_kind": {
            k: round(v / steps, 1) for k, v in sorted(by_kind.items(), key=lambda item: -item[1])
        },
        "all_reduce_kernels_per_step": round(len(reduce_us) / steps, 1),
        "all_reduce_us_quantiles": {q: quantile(reduce_us, float(q)) for q in ("0.1", "0.5", "0.9", "0.99")}
        | {"max": round(reduce_us[-1], 1) if reduce_us else 0.0},
        "top_kernels": {
            name: {"us_per_step": round(sum(d) / steps, 1), "per_step": round(len(d) / steps, 2)}
            for name, d in top
        },
        "host_ms_per_step_call": round(statistics.mean(host_ms), 3) if host_ms else None,
        "step_period_ms": round(statistics.median(period_ms), 3) if period_ms else None,
    }


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Calls the profiler runs before the recorded window: its start (slow, and at a different moment on each
# rank) must not hold up the other ranks inside the window, where they would wait in their all-reduces.
PROFILER_WARMUP_STEPS = 8


def profile_steps(method_owner, method_name: str, rank: int, out_dir: Path) -> None:
    """Wraps a ModelRunner method so that its calls first .. first + steps (WINDOW_ENV) are recorded by
    torch.profiler (started PROFILER_WARMUP_STEPS calls before); at the end the rank's summary and trace go
    to out_dir."""
    import torch

    first, steps = (int(v) for v in os.environ[WINDOW_ENV].split(","))
    start_at = max(0, first - PROFILER_WARMUP_STEPS)
    original = getattr(method_owner, method_name)
    state = {"calls": 0, "profiler": None, "host_ms": [], "starts": []}

    def wrapped(self, *args, **kwargs):
        calls = state["calls"]
        if calls == start_at:
            synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            schedule = torch.profiler.schedule(wait=0, warmup=first - start_at, active=steps, repeat=1)
            state["profiler"] = torch.profiler.profile(activities=activities, schedule=schedule)
            state["profiler"].__enter__()
        if calls == first + steps and state["profiler"] is not None:
            synchronize()
            state["profiler"].__exit__(None, None, None)
            finish(state, rank, steps, out_dir)
            state["profiler"] = None
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            state["calls"] += 1
            if first <= calls < first + steps:
                state["host_ms"].append((time.perf_counter() - started) * 1e3)
                state["starts"].append(started)
            if state["profiler"] is not None:
                state["profiler"].step()

    setattr(method_owner, method_name, wrapped)


def finish(state: dict, rank: int, steps: int, out_dir: Path) -> None:
    trace_path = out_dir / f"rank{rank}.trace.json"
    state["profiler"].export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    starts = state["starts"]
    periods = [(b - a) * 1e3 for a, b in zip(starts, starts[1:])]
    summary = summarize(trace, steps, rank, state["host_ms"], periods)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
    with gzip.open(f"{trace_path}.gz", "wt") as packed:
        json.dump(trace, packed)
    trace_path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out-dir", default="tp_step_profile")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens of each request")
    parser.add_argument("--steps", type=int, default=48, help="steps profiled, from the 64th of the second")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # the spawned ranks read both (the wrap at the bottom)
    os.environ[OUT_DIR_ENV] = str(out_dir)
    os.environ[WINDOW_ENV] = f"{args.tokens + min(64, args.tokens // 4)},{args.steps}"

    from common import MODELS, TOKENIZER  # noqa: I001

    from fitserve import LLM, SamplingParams
    from fitserve.worker.model_runner import ModelRunner

    profile_steps(ModelRunner, "launch", 0, out_dir)
    llm = LLM(
        str(MODELS / args.model),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tp,
        gpu_memory_utilization=0.92,
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    walls = []
    for _ in range(2):
        prompt = {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(128)]}
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        walls.append(time.perf_counter() - started)
    llm.engine.shutdown()
    summaries = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    report = {"model": args.model, "tp": args.tp, "request_seconds": [round(w, 3) for w in walls]}
    report["ranks"] = summaries
    print(json.dumps(report, indent=1))
    (out_dir / "summary.json").write_text(json.dumps(report, indent=1))


if __name__ == "__mp_main__" and os.environ.get(OUT_DIR_ENV):  # a spawned rank of a profiled run
    from fitserve.worker.model_runner import ModelRunner as _Runner

    def _rank() -> int:
        from fitserve.distributed.parallel_state import tp

        return tp().rank

    _dir = Path(os.environ[OUT_DIR_ENV])
    _original_run = _Runner.run_host_inputs

    def _first_call(self, host):  # the rank is known once the group exists: wrap on the first step
        _Runner.run_host_inputs = _original_run
        profile_steps(_Runner, "run_host_inputs", _rank(), _dir)
        return _Runner.run_host_inputs(self, host)

    _Runner.run_host_inputs = _first_call

if __name__ == "__main__":
    main()
