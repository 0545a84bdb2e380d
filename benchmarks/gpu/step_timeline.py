"""Where an offline workload's time goes, step by step: prefill steps against decode steps by batch size.

Runs nano or equal (Qwen3-0.6B shape, dummy weights) through Engine.step and records every step's
wall time with what it computed: decode rows, prefill tokens, and the context tokens the decode rows
attend over. The summary buckets the steps by kind and decode batch size, and sets each bucket's time
against the time to read its KV cache once at the copy bandwidth measured in the same run (the floor
of a bf16 decode step's attention).

With asynchronous scheduling, the step() call that launches step N+1 waits for step N's tokens, so a
call's wall time is charged to the step launched by the call before it.
  python benchmarks/gpu/step_timeline.py nano [--kv-cache-dtype fp8] [--num-requests N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import MODELS, TOKENIZER, copy_bandwidth_bytes_per_s, save  # noqa: I001

from fitserve import LLM, SamplingParams
from fitserve.bench.workloads import named_workload
from fitserve.core.sampling_params import RequestOutputKind

DECODE_BUCKETS = [(1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256)]


def step_record(scheduler_output) -> dict:
    decode_rows = prefill_tokens = context_tokens = 0
    for item in scheduler_output.scheduled:
        if item.start >= item.request.num_prompt_tokens:
            decode_rows += 1
            context_tokens += item.start + 1
        else:
            prefill_tokens += item.num_new_tokens
    return {"decode_rows": decode_rows, "prefill_tokens": prefill_tokens, "context_tokens": context_tokens}


def summarize(steps: list[dict], kv_bytes: int, copy_bytes_per_s: float) -> dict:
    buckets: dict[str, dict] = {}

    def add(name: str, step: dict) -> None:
        bucket = buckets.setdefault(name, {"steps": 0, "seconds": 0.0, "kv_gb": 0.0, "rows": 0})
        bucket["steps"] += 1
        bucket["seconds"] += step["wall_s"]
        bucket["kv_gb"] += step["context_tokens"] * kv_bytes / 1e9
        bucket["rows"] += step["decode_rows"]

    for step in steps:
        if step["prefill_tokens"]:
            add("with prefill", step)
            continue
        for low, high in DECODE_BUCKETS:
            if low <= step["decode_rows"] <= high:
                add(f"decode {low}-{high} rows", step)
    for bucket in buckets.values():
        bucket["ms_per_step"] = round(bucket["seconds"] / bucket["steps"] * 1e3, 3)
        bucket["kv_read_floor_s"] = round(bucket["kv_gb"] * 1e9 / copy_bytes_per_s, 3)
        bucket["seconds"] = round(bucket["seconds"], 3)
        bucket["kv_gb"] = round(bucket["kv_gb"], 1)
    return buckets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["nano", "equal"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--model", default="qwen3-0.6b", help="a shape in shared/models, or a directory")
    parser.add_argument("--num-requests", type=int, default=None, help="the workload's first N requests")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    workload = named_workload(args.workload)
    requests = workload.requests[: args.num_requests]
    model_dir = MODELS / args.model if (MODELS / args.model).is_dir() else Path(args.model)
    llm = LLM(
        str(model_dir),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=workload.max_model_len or 4096,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # compiles
    llm.engine.kv_manager.reset_prefix_cache()
    copy_bytes_per_s = copy_bandwidth_bytes_per_s() if torch.cuda.is_available() else float("nan")

    engine = llm.engine
    for i, request in enumerate(requests):
        params = SamplingParams(
            temperature=workload.temperature,
            max_tokens=request.max_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(str(i), None, request.prompt_token_ids, params)
    launched: list[dict] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        scheduler_output = schedule()
        if not scheduler_output.is_empty:
            launched.append(step_record(scheduler_output))
        return scheduler_output

    engine.scheduler.schedule = recording_schedule
    walls: list[float] = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    # call k+1 waits for the step call k launched; the last call only collects
    for record, wall in zip(launched, walls[1:], strict=False):
        record["wall_s"] = wall
    steps = [r for r in launched if "wall_s" in r]
    runner = engine.executor.runner  # the engine's own figure, in the cache's actual dtype
    kv_bytes = runner.kv_bytes_per_block() // runner.block_size
    output_tokens = sum(r.max_tokens for r in requests)
    save(
        f"step_timeline_{args.workload}"
        + ("" if args.kv_cache_dtype == "auto" else f"_kv_{args.kv_cache_dtype}"),
        {
            "seconds": round(elapsed, 3),
            "out_tok_per_s": round(output_tokens / elapsed, 1),
            "steps": len(steps),
            "copy_bandwidth_gbs": round(copy_bytes_per_s / 1e9, 1),
            "kv_bytes_per_token": kv_bytes,
            "buckets": summarize(steps, kv_bytes, copy_bytes_per_s),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
