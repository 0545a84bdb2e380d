"""int4 (W4A16) linear layers on the GPU: fitserve's int4 GEMM kernels (fitserve/kernels/int4_gemm.py)
against F.linear with bfloat16 weights (cuBLAS), for the Llama-3.1-8B and Llama-3.3-70B weight shapes.

For each weight (K, N) and each row count it times, with CUDA events after a warm-up, the median of many
calls: eagerly (each timed call launched from Python) and, up to 64 rows, as CUDA graph replays (what a
decode step runs, no launch cost). Weights rotate through more copies than the L2 holds, so every call
reads its weight from HBM. It prints and saves per entry: microseconds per call, the bytes an int4 call
moves (packed codes + scales + zero points + x + y; split-K's float32 partials are not counted) and a
bf16 call moves (weight + x + y), the achieved GB/s, and the fraction of two rooflines: the H100 SXM's
3.35 TB/s HBM3 (ASSUMED_HBM_BYTES_PER_S) and the device-to-device copy bandwidth measured in the same run
(reads plus writes, common.copy_bandwidth_bytes_per_s). Every configuration's output is first checked
against the bfloat16 product with the dequantized weight.

  python benchmarks/gpu/int4_gemm.py [--out benchmarks/results/h100_int4_gemm.json] [--quick]
      [--rows 1 2 4 ...] [--models llama-3.1-8b llama-3.3-70b] [--group-size 128] [--sweep]

--sweep also times a grid of launch configurations per entry (int4_gemm.py's docstring lists what is
worth sweeping) and records the fastest beside choose_config's; --quick times fewer row counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
import triton
from common import copy_bandwidth_bytes_per_s, save  # noqa: I001
from skinny_gemm import shapes as layer_shapes

from fitserve.kernels.int4_gemm import Int4GemmConfig, choose_config, int4_linear, resolve_split, sm_count
from fitserve.kernels.int4_repack import dequantize_reference, repack_int4

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)
QUICK_ROWS = (1, 4, 16, 64, 1024, 8192)
GRAPH_MAX_ROWS = 64
ASSUMED_HBM_BYTES_PER_S = 3.35e12  # H100 SXM5 HBM3, datasheet
L2_BYTES_TO_BEAT = 256 << 20  # rotate through at least this many weight bytes
CALLS_PER_GRAPH = 20
EAGER_CALLS = 200


def random_packed_layer(out_features: int, in_features: int, generator, group_size: int = 128):
    """A random int4 weight (scales 0.002-0.012, integer zero points) packed for bfloat16 activations, and
    its dequantized float32 reference."""
    codes = torch.randint(
        0, 16, (out_features, in_features), dtype=torch.uint8, device="cuda", generator=generator
    )
    groups = in_features // group_size
    scales = 0.002 + 0.01 * torch.rand(out_features, groups, device="cuda", generator=generator)
    zeros = torch.randint(0, 16, (out_features, groups), device="cuda", generator=generator).float()
    packed = repack_int4(codes, scales, zeros, group_size, torch.bfloat16)
    return packed, dequantize_reference(codes, scales, zeros, group_size)


def copies_past_l2(first, nbytes: int, clone) -> list:
    """`first` and clones of it (`clone(first)`) until together they outgrow the L2, so that timed calls
    cycling through them read their weight from HBM."""
    copies = [first]
    while len(copies) * nbytes < L2_BYTES_TO_BEAT:
        copies.append(clone(first))
    return copies


def packed_copies(first, fields: tuple[str, ...] = ("qweight", "scale_zero", "counters")) -> list:
    """copies_past_l2 of a packed weight (same values, its tensor `fields` cloned: own counters)."""
    return copies_past_l2(
        first,
        first.nbytes(),
        lambda packed: dataclasses.replace(
            packed, **{name: getattr(packed, name).clone() for name in fields}
        ),
    )


def dense_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """copies_past_l2 of a 16-bit weight."""
    return copies_past_l2(weight, weight.numel() * weight.element_size(), torch.Tensor.clone)


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """Layer name -> (in_features K, out_features N): skinny_gemm.py's decoder layers, transposed."""
    return {name: (k, n) for name, (n, k) in layer_shapes(model).items() if name != "lm_head"}


def median_eager_us(call, operands: list) -> float:
    """Median over EAGER_CALLS of one call's CUDA-event time (cycling through the operands)."""
    for operand in operands[:2]:
        call(operand)
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(EAGER_CALLS)
    ]
    for i, (start, end) in enumerate(events):
        start.record()
        call(operands[i % len(operands)])
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1000


def median_graph_us(call, operands: list, repeats: int = 30) -> float:
    """Median over replays of a CUDA graph of CALLS_PER_GRAPH calls, per call."""
    for operand in operands[:2]:
        call(operand)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(operands[i % len(operands)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    del graph
    return statistics.median(times)


def sweep_configs(rows: int) -> list[Int4GemmConfig]:
    """Launch configurations worth timing at this row count (int4_gemm.py's docstring says why)."""
    configs = []
    if rows <= 4:
        block_m = 1 << (rows - 1).bit_length()
        configs += [
            Int4GemmConfig("gemv", block_m, bn, num_warps=w, num_stages=s, split_k=k)
            for (bn, w), s, k in itertools.product(
                ((32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8)), (2, 3), (None, 1, 2, 4, 8, 16)
            )
        ]
    if rows <= 64:
        block_m = max(16, 1 << (rows - 1).bit_length())
        configs += [
            Int4GemmConfig(
                "dot", block_m, bn, num_warps=4, num_stages=s, split_k=k, swap_ab=swap, wide_k=wide
            )
            for bn, s, k, (swap, wide) in itertools.product(
                (64, 128), (3, 4), (None, 1), ((False, False), (True, False), (True, True))
            )
        ]
        return configs
    tiles = (
        (64, 128, 4, 3),
        (128, 128, 8, 2),
        (128, 256, 8, 2),
        (64, 256, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 4, 2),
    )
    return [
        Int4GemmConfig("dot", bm, bn, num_warps=w, num_stages=s, swap_ab=swap, wide_k=wide)
        for (bm, bn, w, s), swap, wide in itertools.product(tiles, (False, True), (True, False))
    ]


def sweep_call(packed, x: torch.Tensor, config: Int4GemmConfig) -> torch.Tensor:
    return int4_linear(x, packed, config=config)


def check(result: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    error = (result.float() - reference).abs().max().item()
    if error > 2**-6 * reference.abs().max().item():
        raise AssertionError(f"{what}: max error {error} (max |ref| {reference.abs().max().item()})")


def time_entry(timed: dict, key: str, call, operands: list, rows: int, eager: bool = True) -> None:
    """Median microseconds of `call` eagerly (if `eager` or past GRAPH_MAX_ROWS) and, up to
    GRAPH_MAX_ROWS rows, as graph replays."""
    if eager or rows > GRAPH_MAX_ROWS:
        timed[f"{key}_eager_us"] = round(median_eager_us(call, operands), 2)
    if rows <= GRAPH_MAX_ROWS:
        timed[f"{key}_graph_us"] = round(median_graph_us(call, operands), 2)


def add_rates(entry: dict, key: str, moved: int, copy_bandwidth: float) -> None:
    """GB/s and roofline fractions of the best time recorded under `key` (graph if timed, else eager)."""
    us = entry.get(f"{key}_graph_us", entry.get(f"{key}_eager_us"))
    rate = moved / (us * 1e-6)
    entry[f"{key}_gb_per_s"] = round(rate / 1e9, 1)
    entry[f"{key}_hbm_roofline_frac"] = round(rate / ASSUMED_HBM_BYTES_PER_S, 3)
    entry[f"{key}_copy_bw_frac"] = round(rate / copy_bandwidth, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS} only")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configurations")
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "llama-3.3-70b"])
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "gate_up", "down"])
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()
    rows_list = args.rows or (QUICK_ROWS if args.quick else ROWS)
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    print(f"device-to-device copy: {copy_bandwidth / 1e9:.0f} GB/s", flush=True)
    sms = sm_count(torch.device("cuda"))
    results = []
    for model in args.models:
        for layer, (in_features, out_features) in shapes(model).items():
            if layer not in args.layers:
                continue
            group_size = args.group_size
            generator = torch.Generator(device="cuda").manual_seed(0)
            first, dequantized = random_packed_layer(out_features, in_features, generator, group_size)
            dequantized = dequantized.to(torch.bfloat16)
            int4_bytes = first.nbytes()
            bf16_bytes = out_features * in_features * 2
            packs = packed_copies(first)
            weights = dense_copies(dequantized)
            for rows in rows_list:
                x = torch.randn(rows, in_features, device="cuda", generator=generator).to(torch.bfloat16)
                reference = (x.float() @ dequantized.float().T) if rows <= 1024 else None
                config = resolve_split(
                    choose_config(rows, out_features, in_features, sms), rows, out_features, in_features, sms
                )
                moved_int4 = int4_bytes + 2 * rows * (in_features + out_features)
                moved_bf16 = bf16_bytes + 2 * rows * (in_features + out_features)
                entry = {
                    "model": model,
                    "layer": layer,
                    "k": in_features,
                    "n": out_features,
                    "rows": rows,
                    "group_size": group_size,
                    "int4_bytes": moved_int4,
                    "bf16_bytes": moved_bf16,
                    "config": config.__dict__,
                }
                if reference is not None:
                    check(int4_linear(x, first), reference, f"{model} {layer} rows {rows}")
                time_entry(entry, "bf16", lambda w, x=x: F.linear(x, w), weights, rows)
                time_entry(entry, "int4", lambda p, x=x: int4_linear(x, p), packs, rows)
                if args.sweep:
                    best = None
                    for candidate in sweep_configs(rows):
                        try:
                            result = int4_linear(x, first, config=candidate)
                        except triton.runtime.errors.OutOfResources:
                            continue  # more shared memory than a program may have
                        except Exception as error:  # recorded, not fatal: the rest of the sweep still runs
                            entry.setdefault("sweep_failures", []).append(f"{candidate}: {error!r}"[:500])
                            continue
                        if reference is not None:
                            check(result, reference, f"{model} {layer} rows {rows} {candidate}")
                        timed: dict = {}
                        call = functools.partial(sweep_call, x=x, config=candidate)
                        time_entry(timed, "c", call, packs, rows, eager=False)
                        us = timed.get("c_graph_us", timed.get("c_eager_us"))
                        if best is None or us < best[0]:
                            best = (us, candidate, timed)
                    if best is not None:
                        entry["int4_best_config"] = best[1].__dict__
                        for key, value in best[2].items():
                            entry[key.replace("c_", "int4_best_", 1)] = value
                        add_rates(entry, "int4_best", moved_int4, copy_bandwidth)
                add_rates(entry, "bf16", moved_bf16, copy_bandwidth)
                add_rates(entry, "int4", moved_int4, copy_bandwidth)
                bf16_us = entry.get("bf16_graph_us", entry["bf16_eager_us"])
                int4_us = entry.get("int4_graph_us", entry["int4_eager_us"])
                entry["int4_speedup_vs_bf16"] = round(bf16_us / int4_us, 3)
                print(json.dumps(entry), flush=True)
                results.append(entry)
            del packs, weights, dequantized, first
            torch.cuda.empty_cache()
    save(
        "int4_gemm",
        {
            "assumed_hbm_gb_per_s": ASSUMED_HBM_BYTES_PER_S / 1e9,
            "copy_bandwidth_gb_per_s": round(copy_bandwidth / 1e9, 1),
            "sm_count": sms,
            "timing": "CUDA events, median; graph = replays of 20 calls (rows <= 64), eager = one call each",
            "layers": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
