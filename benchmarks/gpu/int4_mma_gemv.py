"""The int4 GEMM at 1 to 16 rows: the register-fed tensor-core kernel (fitserve/kernels/int4_mma_gemv.py)
against the kernels it replaced there (the CUDA-core kernel at 1 row, the tl.dot kernel at 2 to 16:
`int4_gemm.MMA_DECODE = False`) and against bf16 cuBLAS, per Llama layer shape, as CUDA graph replays
with the weights rotating through more copies than the L2 holds (benchmarks/gpu/int4_gemm.py's timing).
With --sweep it also times a grid of its launch configurations (warps, 16-row tiles per warp, split-K)
and records the fastest beside choose_config's.

  python benchmarks/gpu/int4_mma_gemv.py [--out FILE] [--models llama-3.1-8b] [--rows 1 2 4 8 16] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from common import copy_bandwidth_bytes_per_s, save  # noqa: I001
from int4_gemm import check, dense_copies, median_graph_us, packed_copies, random_packed_layer, shapes

from fitserve.kernels import int4_gemm
from fitserve.kernels.int4_gemm import Int4GemmConfig, choose_config, int4_linear, mma_kernel_ok, sm_count


def sweep_configs(rows: int) -> list[Int4GemmConfig]:
    block_m = 8 if rows <= 8 else 16
    return [
        Int4GemmConfig("mma", block_m, 16 * warps * tiles, num_warps=warps, split_k=split)
        for warps, tiles, split in itertools.product((2, 4, 8), (1, 2), (None, 1, 2, 4, 8, 16))
    ]


def summarize(entry: dict, moved: int, copy_bandwidth: float) -> None:
    """Each timed kernel's share of the copy bandwidth (`moved` bytes a call), and the new kernel's speedups
    over the previous one and over bf16."""
    for key in ("mma", "previous", "best"):
        if f"{key}_us" in entry:
            rate = moved / (entry[f"{key}_us"] * 1e-6)
            entry[f"{key}_copy_bw_frac"] = round(rate / copy_bandwidth, 3)
    entry["mma_speedup_vs_previous"] = round(entry["previous_us"] / entry["mma_us"], 3)
    entry["mma_speedup_vs_bf16"] = round(entry["bf16_us"] / entry["mma_us"], 3)


def fastest(entry: dict, candidates: list, run, packs: list, reference, what: str) -> None:
    """Each candidate config checked against the reference (`run(packs[0], config)`) and timed cycling
    through the packs; the fastest's time and config into `entry` (best_us, best_config)."""
    best = None
    for candidate in candidates:
        check(run(packs[0], candidate), reference, f"{what} {candidate}")
        us = timed(lambda p, c=candidate: run(p, c), packs)
        if best is None or us < best[0]:
            best = (us, candidate)
    entry["best_us"], entry["best_config"] = best[0], best[1].__dict__


def timed(call, operands) -> float:
    return round(median_graph_us(call, operands), 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    print(f"device-to-device copy: {copy_bandwidth / 1e9:.0f} GB/s", flush=True)
    sms = sm_count(torch.device("cuda"))
    results = []
    for model in args.models:
        for layer, (in_features, out_features) in shapes(model).items():
            generator = torch.Generator(device="cuda").manual_seed(0)
            first, dequantized = random_packed_layer(out_features, in_features, generator, args.group_size)
            dequantized = dequantized.to(torch.bfloat16)
            packs = packed_copies(first)
            weights = dense_copies(dequantized)
            for rows in args.rows:
                x = torch.randn(rows, in_features, device="cuda", generator=generator).to(torch.bfloat16)
                assert mma_kernel_ok(x, first)
                reference = x.float() @ dequantized.float().T
                config = choose_config(rows, out_features, in_features, sms, mma=True)
                check(int4_linear(x, first), reference, f"{model} {layer} rows {rows}")
                moved = first.nbytes() + 2 * rows * (in_features + out_features)
                entry = {"model": model, "layer": layer, "k": in_features, "n": out_features, "rows": rows}
                entry["mma_config"] = config.__dict__
                entry["bf16_us"] = timed(lambda w, x=x: F.linear(x, w), weights)
                entry["mma_us"] = timed(lambda p, x=x: int4_linear(x, p), packs)
                int4_gemm.MMA_DECODE = False
                try:
                    entry["previous_config"] = choose_config(rows, out_features, in_features, sms).__dict__
                    entry["previous_us"] = timed(lambda p, x=x: int4_linear(x, p), packs)
                finally:
                    int4_gemm.MMA_DECODE = True
                if args.sweep:
                    run = lambda p, c, x=x: int4_linear(x, p, config=c)  # noqa: E731
                    fastest(entry, sweep_configs(rows), run, packs, reference, f"{layer} {rows}")
                summarize(entry, moved, copy_bandwidth)
                print(json.dumps(entry), flush=True)
                results.append(entry)
            del packs, weights, dequantized, first
            torch.cuda.empty_cache()
    save(
        "int4_mma_gemv",
        {
            "copy_bandwidth_gb_per_s": round(copy_bandwidth / 1e9, 1),
            "sm_count": sms,
            "group_size": args.group_size,
            "timing": "CUDA graph replays of 20 calls, median (benchmarks/gpu/int4_gemm.py median_graph_us)",
            "layers": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
