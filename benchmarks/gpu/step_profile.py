"""Where a decode step's time goes: host phases of Engine.step against the GPU kernel time.

Runs the equal workload's shape (Qwen3-0.6B, 256 x 512 in) and, once every request is decoding,
times 50 steps: wall time per step, the host time of each phase (schedule, prepare + launch, detokenize
the previous step while the device runs, wait for the device, scheduler update), and the summed CUDA
kernel time per step from torch.profiler.
  python benchmarks/gpu/step_profile.py [--batch 256]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from common import MODELS, TOKENIZER, save  # noqa: I001

from fitserve import LLM, SamplingParams

STEPS = 50


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(str(MODELS / args.model), tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=4096)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), None, [rng.randint(0, 10000) for _ in range(512)], params)
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
    engine._process_pending = timed("detokenize_previous", engine._process_pending)
    launch = executor.launch

    def timed_launch(so):
        start = time.perf_counter()
        finish = launch(so)
        phases["prepare_and_launch"] += time.perf_counter() - start
        return timed("wait_for_device", finish)

    executor.launch = timed_launch
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    top = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:8]
    for request_id in list(engine.output_processor.parents):
        engine.abort_request([request_id])
    save(
        f"step_profile_{args.model}_b{args.batch}",
        {
            "batch": args.batch,
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
