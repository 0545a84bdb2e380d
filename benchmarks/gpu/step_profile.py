"""Where a decode step's time goes: host phases of Engine.step against the GPU kernel time.

Runs the equal workload's shape (Qwen3-0.6B, 256 x 512 in) and, once every request is decoding,
times 50 steps: wall time per step, the host time of each phase of Engine.step (schedule step N+1,
prepare + launch it, then while it runs: wait for step N's tokens, update the scheduler, detokenize),
and the summed CUDA kernel time per step from torch.profiler. Host phases below the kernel time are
hidden behind the device.
  python benchmarks/gpu/step_profile.py [--batch 256] [--model qwen3-0.6b] [--input-len 512]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from common import MODELS, TOKENIZER, save  # noqa: I001

from fitserve import LLM, SamplingParams
from fitserve.engine.sampling_params import RequestOutputKind

STEPS = 50


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens of every request")
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=8, help="kernels to list, by time")
    parser.add_argument("--trace", default=None, help="also save a Chrome trace (CPU + CUDA) of 6 steps here")
    args = parser.parse_args()
    llm = LLM(str(MODELS / args.model), tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=4096)
    engine = llm.engine
    rng = random.Random(0)
    # FINAL_ONLY, as LLM.generate uses: no per-step RequestOutput for unfinished requests.
    params = SamplingParams(
        temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i in range(args.batch):
        engine.add_request(str(i), None, [rng.randint(0, 10000) for _ in range(args.input_len)], params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()

    phases: dict[str, float] = defaultdict(float)
    scheduler, executor = engine.scheduler, engine.executor

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            result = fn(*a, **k)
            phases[name] += time.perf_counter() - start
            return result

        return wrapper

    scheduler.schedule = timed("schedule", scheduler.schedule)
    scheduler.update_from_output = timed("update", scheduler.update_from_output)
    processor = engine.output_processor
    processor.apply_tokens = timed("detokenize", processor.apply_tokens)
    launch = executor.launch

    def timed_launch(so):
        start = time.perf_counter()
        launched = launch(so)
        phases["prepare_and_launch"] += time.perf_counter() - start
        launched.result = timed("wait_for_device", launched.result)
        return launched

    executor.launch = timed_launch
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if args.trace:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, with_stack=True) as traced:
            for _ in range(6):
                engine.step()
            torch.cuda.synchronize()
        traced.export_chrome_trace(args.trace)
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    top = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[: args.top]
    for request_id in list(engine.output_processor.parents):
        engine.abort_request([request_id])
    save(
        f"step_profile_{args.model}_b{args.batch}",
        {
            "batch": args.batch,
            "input_len": args.input_len,
            "steps": STEPS,
            "wall_ms_per_step": round(wall / STEPS * 1e3, 3),
            "gpu_kernel_ms_per_step": round(kernel_us / STEPS / 1e3, 3),
            "host_ms_per_step": {k: round(v / STEPS * 1e3, 3) for k, v in phases.items()},
            "top_kernels_ms_per_step": {e.key[:80]: round(e.device_time_total / STEPS / 1e3, 3) for e in top},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
