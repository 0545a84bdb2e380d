"""The int4 tensor-core kernel with packed-pair dequantization (fitserve/kernels/int4_pair_dequant.py)
against the float32 route and the batch-1 CUDA-core kernel, per Llama-3.1-8B layer and row count, as
CUDA-graph replays (what a decode step runs). For each (layer, rows) it times choose_config's pick, then a
grid of dot configurations with and without pairing, and records every time, so that choose_config can
be set from the figures.

  python benchmarks/gpu/int4_paired_sweep.py [--rows 1 4 16 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json

import torch
import triton
from common import copy_bandwidth_bytes_per_s, save_sweep  # noqa: I001
from int4_gemm import check, median_graph_us, packed_copies, random_packed_layer, shapes

from fitserve.kernels.int4_gemm import Int4GemmConfig, choose_config, int4_linear, sm_count


def grid(rows: int) -> list[Int4GemmConfig]:
    """Dot configurations worth timing at this row count, each with and without pairing."""
    block_m = max(16, 1 << (rows - 1).bit_length())
    if rows <= 16:
        shapes_ = [
            (bn, 4, s, swap, wide) for bn in (64, 128) for s in (3, 4) for swap, wide in ((0, 0), (1, 0))
        ]
        shapes_ += [(64, 4, 3, 1, 1), (128, 8, 3, 0, 0), (128, 8, 3, 1, 0)]
    else:
        shapes_ = [
            (bn, w, s, swap, wide)
            for bn, w, s in itertools.product((64, 128), (4, 8), (2, 3))
            for swap, wide in ((1, 0), (1, 1), (0, 1))
        ]
    return [
        Int4GemmConfig(
            "dot",
            block_m,
            bn,
            num_warps=w,
            num_stages=s,
            swap_ab=bool(swap),
            wide_k=bool(wide),
            paired=paired,
        )
        for (bn, w, s, swap, wide) in shapes_
        for paired in (True, False)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "gate_up", "down"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    sms = sm_count(torch.device("cuda"))
    results = []
    for layer, (in_features, out_features) in shapes("llama-3.1-8b").items():
        if layer not in args.layers:
            continue
        generator = torch.Generator(device="cuda").manual_seed(0)
        first, dequantized = random_packed_layer(out_features, in_features, generator)
        assert first.paired_zeros
        packs = packed_copies(first)
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", generator=generator).to(torch.bfloat16)
            reference = x.float() @ dequantized.to(torch.bfloat16).float().T
            chosen = choose_config(rows, out_features, in_features, sms)
            entry = {"layer": layer, "k": in_features, "n": out_features, "rows": rows, "times": []}
            for config in [chosen, *grid(rows)]:
                try:
                    result = int4_linear(x, first, config=config)
                except triton.runtime.errors.OutOfResources:
                    continue
                except Exception as error:  # recorded: the rest of the sweep still runs
                    entry["times"].append({"config": dataclasses.asdict(config), "error": repr(error)[:300]})
                    continue
                check(result, reference, f"{layer} rows {rows} {config}")
                call = functools.partial(lambda p, x, c: int4_linear(x, p, config=c), x=x, c=config)
                us = round(median_graph_us(call, packs), 2)
                moved = first.nbytes() + 2 * rows * (in_features + out_features)
                entry["times"].append(
                    {
                        "config": dataclasses.asdict(config),
                        "chosen": config is chosen,
                        "us": us,
                        "copy_bw_frac": round(moved / (us * 1e-6) / copy_bandwidth, 3),
                    }
                )
            timed = [t for t in entry["times"] if "us" in t]
            best = min(timed, key=lambda t: t["us"])
            entry["chosen_us"] = timed[0]["us"] if timed and timed[0].get("chosen") else None
            entry["best"] = best
            print(
                json.dumps({k: entry[k] for k in ("layer", "rows", "chosen_us")} | {"best": best}), flush=True
            )
            results.append(entry)
        del packs, first, dequantized
        torch.cuda.empty_cache()
    save_sweep("int4_paired_sweep", copy_bandwidth, sms, "entries", results, args.out)


if __name__ == "__main__":
    main()
