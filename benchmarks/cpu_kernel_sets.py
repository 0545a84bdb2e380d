"""CPU: each C kernel's time per call on every kernel set this CPU has (avx512, avx_vnni, avx2), at
SmolLM2-135M's shapes, the sets interleaved so that other load on a shared machine hits them alike.

Per kernel and set: the best of `--rounds` rounds of `--calls` calls, in microseconds per call, on
`--threads` threads (default 1: per-core speed, steady on a busy machine). The int4 GEMM at 1 row (a
decode step), 16 (16 sequences) and 256 (a prefill chunk); decode attention over 1,000 cached tokens;
RMSNorm with the residual; SiLU-and-mul. The speed of the whole model: benchmarks/cpu_smollm2.py --kernels.

Usage: python benchmarks/cpu_kernel_sets.py [--out benchmarks/results/cpu_kernel_sets.json] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import torch

from fitserve.layers.cpu.c_kernels import library
from fitserve.layers.cpu.c_kernels.int4_layout import pack_for_kernel

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M


def gemm_case(out_features: int, in_features: int, rows: int) -> Callable[[library.CpuKernels], object]:
    gen = torch.Generator().manual_seed(out_features + rows)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
    step = (torch.rand(out_features, in_features // 32, generator=gen) * 0.01 + 1e-3).half()
    packed, scales = pack_for_kernel(codes, step, (-8 * step.float()).half())
    x = torch.randn(rows, in_features, generator=gen)
    return lambda kernels: kernels.int4_gemm(x, packed, scales, out_features)


def attention_case(context: int) -> Callable[[library.CpuKernels], object]:
    block_size = 16
    blocks = context // block_size + 1
    cache = torch.randn(2, blocks, block_size, KV_HEADS, HEAD_DIM)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    seq_lens, slots = torch.tensor([context], dtype=torch.int32), torch.tensor([context - 1])
    q = torch.randn(1, HEADS, HEAD_DIM)
    k, v = torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    return lambda kernels: kernels.decode_attention(q, k, v, cache, slots, tables, seq_lens, HEAD_DIM**-0.5)


def cases() -> dict[str, Callable[[library.CpuKernels], object]]:
    x, residual, weight = torch.randn(1, HIDDEN), torch.randn(1, HIDDEN), torch.randn(HIDDEN)
    gate_up = torch.randn(1, 2 * INTERMEDIATE)
    return {
        "int4_gemm_gate_up_1_row": gemm_case(2 * INTERMEDIATE, HIDDEN, 1),
        "int4_gemm_down_1_row": gemm_case(HIDDEN, INTERMEDIATE, 1),
        "int4_gemm_gate_up_16_rows": gemm_case(2 * INTERMEDIATE, HIDDEN, 16),
        "int4_gemm_gate_up_256_rows": gemm_case(2 * INTERMEDIATE, HIDDEN, 256),
        "decode_attention_1000_tokens": attention_case(1000),
        "add_rms_norm": lambda kernels: kernels.elementwise.add_rms_norm_(x, residual, weight, 1e-5),
        "silu_and_mul": lambda kernels: kernels.elementwise.silu_and_mul(gate_up),
    }


def per_call_us(
    run: Callable[[library.CpuKernels], object], kernels: library.CpuKernels, calls: int
) -> float:
    run(kernels)  # warm
    start = time.perf_counter()
    for _ in range(calls):
        run(kernels)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/cpu_kernel_sets.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sets = {s.name: library.load_kernel_set(s.name) for s in library.supported_sets()}
    sets = {name: kernels for name, kernels in sets.items() if kernels is not None}
    if not sets:
        raise SystemExit(f"no C kernel set runs here: {library.unavailable_reason() or 'see the log'}")
    runs = cases()
    timings: dict[str, dict[str, list[float]]] = {case: {name: [] for name in sets} for case in runs}
    load_before = round(os.getloadavg()[0], 2)
    for _ in range(args.rounds):
        for case, run in runs.items():
            for name, kernels in sets.items():
                timings[case][name].append(per_call_us(run, kernels, args.calls))
    best = {case: {name: round(min(t), 2) for name, t in by_set.items()} for case, by_set in timings.items()}
    result = {
        "benchmark": "cpu_kernel_sets",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "threads": args.threads,
        "kernel_sets": {name: kernels.kernel_set.description for name, kernels in sets.items()},
        "load_avg_1min_before_after": [load_before, round(os.getloadavg()[0], 2)],
        "note": "microseconds per call, the best of `rounds` rounds of `calls` calls, sets interleaved",
        "us_per_call": best,
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
