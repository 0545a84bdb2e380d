"""Where a decode step's time goes: host phases of Engine.step against the GPU kernel time.

Runs the equal workload's shape (Qwen3-0.6B, 256 x 512 in) and, once every request is decoding,
times 50 steps: wall time per step and the host time of each phase of Engine.step (schedule step
N+1, prepare + launch it, then while it runs: wait for step N's tokens, update the scheduler,
detokenize); then 50 more under torch.profiler for the summed CUDA kernel time per step (and, with
--host-ops, the busiest host ops). Host phases below the kernel time are hidden behind the device.
  python benchmarks/gpu/step_profile.py [--batch 256] [--model qwen3-0.6b] [--input-len 512]
  python benchmarks/gpu/step_profile.py --prefill   # the first 8 steps instead: prefill chunks
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import MODELS, TOKENIZER, save  # noqa: I001

from fitserve import LLM, SamplingParams
from fitserve.core.sampling_params import RequestOutputKind
from fitserve.kernels import dependent_launch

STEPS = 50
PREFILL_STEPS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens of every request")
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (auto-fit)")
    parser.add_argument("--top", type=int, default=8, help="kernels to list, by time")
    parser.add_argument(
        "--prefill",
        action="store_true",
        help=f"time the first {PREFILL_STEPS} steps instead: prefill chunks of max_num_batched_tokens",
    )
    parser.add_argument("--host-ops", type=int, default=0, help="also list the N busiest host ops (profiled)")
    parser.add_argument(
        "--python-functions", type=int, default=0, help="also list the N Python functions with most own time"
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch without PDL: each kernel's time then excludes its wait for the one before",
    )
    parser.add_argument("--trace", default=None, help="also save a Chrome trace (CPU + CUDA) of 6 steps here")
    args = parser.parse_args()
    if args.no_pdl:
        dependent_launch.ENABLED = False
    llm = LLM(
        str(MODELS / args.model),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=args.max_model_len,
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
    )
    engine = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.input_len)] for _ in range(args.batch)]
    if args.prefill:  # compile the prefill kernels' variants first, as the throughput workloads do
        warm_up = [{"prompt_token_ids": ids} for ids in prompts]
        llm.generate(warm_up, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        engine.kv_manager.reset_prefix_cache()
    add_requests(engine, prompts, "timed")
    if not args.prefill:
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
    steps = PREFILL_STEPS if args.prefill else STEPS
    phases = time_engine_phases(engine)

    wall = run_steps(engine, steps)  # host phases and wall time without the profiler's overhead
    host_ms = {name: round(seconds / steps * 1e3, 3) for name, seconds in phases.items()}
    python_functions = {}
    if args.python_functions:  # the same steps again under cProfile: where the host's Python goes
        if args.prefill:
            abort_all(engine)
            engine.kv_manager.reset_prefix_cache()
            add_requests(engine, prompts, "cprofiled")
        python_functions = busiest_python_functions(engine, steps, args.python_functions)
    if args.prefill:  # the same prefill steps again, for the profiler
        abort_all(engine)
        engine.kv_manager.reset_prefix_cache()
        add_requests(engine, prompts, "profiled")
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if args.host_ops:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        profiled_wall = run_steps(engine, steps)
    if args.trace:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, with_stack=True) as traced:
            run_steps(engine, 6)
        traced.export_chrome_trace(args.trace)
    abort_all(engine)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_time_total > 0]
    kernel_us = sum(e.device_time_total for e in kernels)
    top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[: args.top]
    figures = {
        "batch": args.batch,
        "input_len": args.input_len,
        "steps": steps,
        "prefill": args.prefill,
        "pdl": not args.no_pdl,
        "wall_ms_per_step": round(wall / steps * 1e3, 3),
        "wall_ms_per_step_profiled": round(profiled_wall / steps * 1e3, 3),
        "gpu_kernel_ms_per_step": round(kernel_us / steps / 1e3, 3),
        "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1),
        "host_ms_per_step": host_ms,
        "top_kernels_ms_per_step": {e.key[:80]: round(e.device_time_total / steps / 1e3, 3) for e in top},
        "top_kernels_launches_per_step": {e.key[:80]: round(e.count / steps, 1) for e in top},
    }
    if python_functions:
        figures["top_python_functions_ms_per_step"] = python_functions
    if args.host_ops:
        busiest = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.host_ops]
        figures["top_host_ops_ms_per_step"] = {
            e.key[:80]: [round(e.self_cpu_time_total / steps / 1e3, 3), round(e.count / steps, 1)]
            for e in busiest
        }
    save(f"step_profile_{args.model}_b{args.batch}" + ("_prefill" if args.prefill else ""), figures, args.out)


def busiest_python_functions(engine, steps: int, count: int) -> dict[str, list[float]]:
    """{function: [own ms per step, ms per step including callees]} of the `count` with most own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(engine, steps)
    profiler.disable()
    stats = pstats.Stats(
        profiler
    ).stats  # {(file, line, name): (calls, primitive calls, own, cumulative, ...)}
    busiest = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return {
        f"{Path(file).name}:{line}:{name}": [round(own / steps * 1e3, 3), round(cumulative / steps * 1e3, 3)]
        for (file, line, name), (_, _, own, cumulative, _) in busiest
    }


def add_requests(engine, prompts: list[list[int]], prefix: str) -> None:
    # FINAL_ONLY, as LLM.generate uses: no per-step RequestOutput for unfinished requests.
    params = SamplingParams(
        temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", None, prompt, params)


def abort_all(engine) -> None:
    for request_id in list(engine.output_processor.parents):
        engine.abort_request([request_id])
    while engine.has_unfinished_requests():
        engine.step()


def run_steps(engine, steps: int) -> float:
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize()
    return time.perf_counter() - start


def time_engine_phases(engine) -> dict[str, float]:
    """Wraps the phases of Engine.step with timers; returns the dict they add their seconds to."""
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

    def timed_launch(scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        launched = launch(scheduler_output, *args, **kwargs)
        phases["prepare_and_launch"] += time.perf_counter() - start
        launched.result = timed("wait_for_device", launched.result)
        return launched

    executor.launch = timed_launch
    return phases


if __name__ == "__main__":
    main()
