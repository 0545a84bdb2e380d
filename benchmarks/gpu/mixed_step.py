"""What a prompt chunk costs the streams that are decoding beside it (serving at concurrency 32).

Runs BATCH - 1 requests of CONTEXT tokens until they all decode, times pure decode steps, then adds
one request of PROMPT tokens at a time and times the WINDOW steps that follow (its prefill chunks,
then decode). Each window's time minus that of a window of pure decode steps is the stall that prompt
put on every running stream. Then profiles one window (CUDA kernels by time) and one pure decode window.
  python benchmarks/gpu/mixed_step.py [--model llama-3.1-8b] [--chunk 1024] [--batch 32]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from pathlib import Path

import torch
from common import MODELS, TOKENIZER, save  # noqa: I001
from step_profile import time_engine_phases

from fitserve import LLM, SamplingParams
from fitserve.core.sampling_params import RequestOutputKind

WINDOW = 12
DECODE_WINDOWS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1536, help="tokens of each decoding request")
    parser.add_argument("--prompt", type=int, default=1024, help="tokens of each arriving prompt")
    parser.add_argument("--chunk", type=int, default=1024, help="--max-num-batched-tokens")
    parser.add_argument("--arrivals", type=int, default=6)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--python-functions", type=int, default=0, help="also list the N Python functions with most own time"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(str(MODELS / args.model), tokenizer=str(TOKENIZER), load_format="dummy",
              max_model_len=4096, max_num_batched_tokens=args.chunk)  # fmt: skip
    engine = llm.engine
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randint(0, 10000) for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    for i in range(args.batch - 1):
        engine.add_request(f"decode-{i}", None, prompt(args.context), params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()

    def window(arriving: str | None, keep: bool = False) -> list[float]:
        if arriving is not None:
            engine.add_request(arriving, None, prompt(args.prompt), params)
        times = []
        torch.cuda.synchronize()
        for _ in range(WINDOW):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        if arriving is not None and not keep:
            engine.abort_request([arriving])
            engine.step()
        return times

    phases = time_engine_phases(engine)
    decode_windows = [window(None) for _ in range(DECODE_WINDOWS)]
    decode_host = host_ms_per_step(phases, DECODE_WINDOWS * WINDOW)
    mixed_windows = [window(f"arrival-{i}") for i in range(args.arrivals)]
    mixed_host = host_ms_per_step(phases, args.arrivals * WINDOW)
    # A window's first step is short (nothing in flight before it): windows are compared whole, each
    # with the median decode window, which a one-off host stall in one of them does not move.
    decode_window_ms = statistics.median(sum(w) for w in decode_windows) * 1e3
    window("kept", keep=True)  # an arrival that stays: then BATCH rows decode, all of them real
    full_batch = window(None)
    engine.abort_request(["kept"])
    engine.step()
    last_decode = window(None)
    stalls = [sum(w) * 1e3 - decode_window_ms for w in mixed_windows]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        window("profiled")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as decode_prof:
        window(None)
    python_functions = {}
    if args.python_functions:  # one more arrival's window under cProfile: where the host's time goes
        profiler = cProfile.Profile()
        profiler.enable()
        window("cprofiled")
        profiler.disable()
        python_functions = busiest_python_functions(profiler, args.python_functions)
    figures = {
        "batch": args.batch, "context": args.context, "prompt": args.prompt, "chunk": args.chunk,
        "window_steps": WINDOW,
        "decode_window_ms_median": round(decode_window_ms, 2),
        "stall_ms_per_prompt": [round(s, 2) for s in stalls],
        "stall_ms_per_prompt_mean": round(sum(stalls) / len(stalls), 2),
        "first_decode_window_step_ms": ms(decode_windows[0]),
        "full_batch_decode_window_step_ms": ms(full_batch),
        "last_decode_window_step_ms": ms(last_decode),
        "mixed_window_step_ms": ms(mixed_windows[-1]),
        "host_ms_per_step_decode": decode_host,
        "host_ms_per_step_mixed": mixed_host,
        "kernel_ms_mixed_window": kernel_ms(prof),
        "kernel_ms_decode_window": kernel_ms(decode_prof),
        "top_kernels_ms_mixed_window": top_kernels(prof, args.top),
        "top_kernels_ms_decode_window": top_kernels(decode_prof, args.top),
    }  # fmt: skip
    if python_functions:
        figures["top_python_functions_ms_per_window"] = python_functions
    save(f"mixed_step_{args.model}_chunk{args.chunk}", figures, args.out)


def host_ms_per_step(phases: dict[str, float], steps: int) -> dict[str, float]:
    """The host phases' ms per step since the last call (which empties `phases`)."""
    figures = {name: round(seconds / steps * 1e3, 3) for name, seconds in phases.items()}
    phases.clear()
    return figures


def busiest_python_functions(profiler: cProfile.Profile, count: int) -> dict[str, list[float]]:
    """{function: [own ms, ms including callees, calls]} over the window, by own time."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, own, cumulative, _)}
    busiest = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return {
        f"{Path(file).name}:{line}:{name}": [round(own * 1e3, 2), round(cumulative * 1e3, 2), calls]
        for (file, line, name), (calls, _, own, cumulative, _) in busiest
    }


def ms(times: list[float]) -> list[float]:
    return [round(t * 1e3, 2) for t in times]


def kernel_ms(prof) -> float:
    return round(sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / 1e3, 2)


def top_kernels(prof, count: int) -> dict[str, list[float]]:
    """{kernel: [ms in the window, launches]} of the `count` with most time."""
    top = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:count]
    return {e.key[:90]: [round(e.device_time_total / 1e3, 3), e.count] for e in top}


if __name__ == "__main__":
    main()
