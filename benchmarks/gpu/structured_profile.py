"""Where structured outputs' extra time per step goes (issue 33's TPOT goal), on one GPU.

  python benchmarks/gpu/structured_profile.py [--top 25] [--out FILE]

The workload of structured_suite.py (Llama-3.1-8B shape, dummy weights, 32 requests of 512 prompt tokens,
256 output tokens, greedy), run unconstrained and then under the 10-field JSON schema, each twice: once
under cProfile (the host functions whose own time grows, per step) and once under torch.profiler (the GPU
kernels' time per step, and the GPU's idle share of the run). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

from common import save  # noqa: I001
from structured_suite import workload


def _host_profile(llm, prompts, params, steps: int, top: int) -> dict[str, float]:
    """Own time (tottime) per step in microseconds of the `top` busiest host functions."""
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_, _, tottime, _, _) in stats.items():
        where = f"{Path(filename).name}:{line}:{name}"
        rows.append((tottime, where))
    rows.sort(reverse=True)
    return {where: round(1e6 * seconds / steps, 1) for seconds, where in rows[:top]}


def _gpu_profile(llm, prompts, params, steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    kernels = []
    busy = 0.0
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if device_us > 0:
            kernels.append((device_us, event.key[:90], event.count))
            busy += device_us
    kernels.sort(reverse=True)
    return {
        "wall_ms_per_step": round(1000 * wall / steps, 3),
        "gpu_kernel_ms_per_step": round(busy / 1000 / steps, 3),
        "top_kernels_us_per_step": {name: round(us / steps, 1) for us, name, _ in kernels[:top]},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    steps = 256
    llm, prompts, plain, constrained = workload(steps)
    result: dict = {}
    for name, params in (("plain", plain), ("structured_json", constrained)):
        result[f"{name}_host_us_per_step"] = _host_profile(llm, prompts, params, steps, args.top)
        result[f"{name}_gpu"] = _gpu_profile(llm, prompts, params, steps, args.top)
    save("structured_profile", result, args.out)


if __name__ == "__main__":
    main()
