"""Batch-1 launch configurations of the CUDA-core int4 and nf4 kernels (kernels/int4_gemv_kernel.py,
kernels/nf4_gemm.py) and of the fp8 decode kernel (kernels/fp8_w8a16.py): per layer of Llama-3.1-8B (and
for int4 Llama-3.3-70B), each kernel's tile with 2, 3 and 4 pipeline stages and every split-K from 1 to
16, as CUDA-graph replays (what a batch-1 decode step runs), weights rotated past the L2. Each output is
first checked against the layer's reference (int4 and fp8: x.float() @ W.T with the dequantized weight;
nf4: the chosen configuration's output). The fastest configurations per layer beside the chooser's pick
show how the split-K rules should read: past about 4 programs an SM, or with a short last split, a split
costs more than the parallelism it adds. --maxnreg adds the int4 tile with a register cap (more
resident programs, spills).

  python benchmarks/gpu/batch1_split_sweep.py [--models llama-3.1-8b llama-3.3-70b] [--nf4] [--fp8]
      [--no-int4] [--maxnreg 128 96] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
from common import copy_bandwidth_bytes_per_s, save_sweep  # noqa: I001
from int4_gemm import median_graph_us, packed_copies, random_packed_layer, shapes

from fitserve.kernels.fp8_w8a16 import choose_splits, fp8_w8a16_linear, split_counters
from fitserve.kernels.int4_gemm import Int4GemmConfig, choose_config, int4_linear, sm_count
from fitserve.kernels.nf4_gemm import choose_config as nf4_choose_config
from fitserve.kernels.nf4_gemm import nf4_linear
from fitserve.kernels.nf4_pack import pack_nf4
from fitserve.layers.quantization.bnb_weight import random_nf4_weight

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
L2_BYTES_TO_BEAT = 256 << 20


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def timed_entries(call, configs, operands, reference, moved, copy_bandwidth) -> list[dict]:
    out = []
    for config in configs:
        try:
            error = relative_error(call(operands[0], config), reference)
            if error > 2**-6:
                raise AssertionError(f"relative error {error}")
        except Exception as failure:  # recorded: the rest of the sweep still runs
            out.append({"config": dataclasses.asdict(config), "error": repr(failure)[:200]})
            continue
        us = median_graph_us(functools.partial(lambda p, c: call(p, c), c=config), operands)
        out.append(
            {
                "config": dataclasses.asdict(config),
                "us": round(us, 2),
                "copy_bw_frac": round(moved / (us * 1e-6) / copy_bandwidth, 3),
            }
        )
    return out


def summary(layer: str, kind: str, chosen_us: float, entries: list[dict]) -> dict:
    timed = sorted((e for e in entries if "us" in e), key=lambda e: e["us"])
    best = timed[0]
    line = {"kind": kind, "layer": layer, "chosen_us": chosen_us, "best_us": best["us"]}
    line["best"] = {
        k: best["config"].get(k) for k in ("block_n", "num_warps", "num_stages", "split_k", "maxnreg")
    }
    print(line, flush=True)
    return line


def layer_result(
    model, layer, in_features, out_features, fmt: str, kind: str, entries: list, **extra
) -> dict:
    """One layer's record: its shape, the chooser's pick (entries[0]) and the grid, with the summary line."""
    return {
        "model": model,
        "layer": layer,
        "k": in_features,
        "n": out_features,
        "format": fmt,
        **extra,
        "summary": summary(layer, kind, entries[0].get("us"), entries[1:]),
        "chosen": entries[0],
        "entries": entries[1:],
    }


def int4_layer(
    model, layer, in_features, out_features, sms, copy_bandwidth, generator, maxnregs=(), rows=1
) -> dict:
    first, weight = random_packed_layer(out_features, in_features, generator)
    weight = weight.to(torch.bfloat16)
    x = torch.randn(rows, in_features, device="cuda", generator=generator).to(torch.bfloat16)
    reference = x.float() @ weight.float().T
    del weight
    packs = packed_copies(first)
    chosen = choose_config(rows, out_features, in_features, sms)
    if rows > 1:  # the tensor-core kernel's pick at its own tile, every split
        configs = [chosen] + [dataclasses.replace(chosen, split_k=s) for s in SPLITS]
    else:
        configs = [chosen] + [
            Int4GemmConfig("gemv", 1, bn, num_warps=w, num_stages=st, split_k=s)
            for bn, w in ((64, 2), (128, 4), (32, 1))
            for st in (2, 3, 4)
            for s in SPLITS
        ]
    configs += [
        Int4GemmConfig("gemv", 1, 64, num_warps=2, num_stages=3, split_k=s, maxnreg=r)
        for r in maxnregs
        for s in SPLITS
    ]
    moved = first.nbytes() + 2 * rows * (in_features + out_features)
    entries = timed_entries(
        lambda p, c: int4_linear(x, p, config=c), configs, packs, reference, moved, copy_bandwidth
    )
    return layer_result(model, layer, in_features, out_features, "int4 g128", "int4", entries, rows=rows)


def nf4_layer(
    model, layer, in_features, out_features, sms, copy_bandwidth, generator, lookups=(3,), rows=1
) -> dict:
    weight = random_nf4_weight(out_features, in_features, 64, 0.02, generator, "cuda")
    first = pack_nf4(weight.packed, weight.absmax, weight.code, 64, torch.bfloat16)
    nbytes = first.packed.numel() + first.scales.numel() * first.scales.element_size()
    packs = [first] + [
        dataclasses.replace(
            first, packed=first.packed.clone(), scales=first.scales.clone(), counters=first.counters.clone()
        )
        for _ in range(L2_BYTES_TO_BEAT // nbytes)
    ]
    x = torch.randn(rows, in_features, device="cuda", generator=generator).to(torch.bfloat16)
    chosen = nf4_choose_config(rows, out_features, in_features, 64, sms)
    reference = nf4_linear(x, first, None, chosen)
    if rows > 1:  # the tensor-core kernel at its tile: each lookup at every split
        configs = [chosen] + [
            dataclasses.replace(chosen, split_k=s, lookup=lookup) for lookup in lookups for s in SPLITS
        ]
    else:
        configs = [chosen] + [
            dataclasses.replace(chosen, block_n=bn, num_warps=w, num_stages=st, split_k=s, lookup=lookup)
            for lookup in lookups
            for bn, w in ((64, 2), (128, 4))
            for st in (2, 3, 4)
            for s in SPLITS
        ]
    entries = timed_entries(
        lambda p, c: nf4_linear(x, p, None, c),
        configs,
        packs,
        reference,
        nbytes + 2 * rows * (in_features + out_features),
        copy_bandwidth,
    )
    return layer_result(model, layer, in_features, out_features, "nf4 block 64", "nf4", entries, rows=rows)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int


def fp8_layer(model, layer, in_features, out_features, sms, copy_bandwidth, generator) -> dict:
    """kernels/fp8_w8a16.py at one row, per-channel scales: its default tile at every split-K, and
    BLOCK_N 64."""
    first = (torch.randn(out_features, in_features, device="cuda", generator=generator) * 0.3).to(
        torch.float8_e4m3fn
    )
    scale = 0.5 + torch.rand(out_features, 1, device="cuda", generator=generator)
    counters = split_counters(out_features, "cuda")
    weights = [first] + [first.clone() for _ in range(L2_BYTES_TO_BEAT // first.numel())]
    x = torch.randn(1, in_features, device="cuda", generator=generator).to(torch.bfloat16)
    reference = x.float() @ (first.float() * scale).T
    chosen = Fp8Config(32, 256, 4, 4, choose_splits(out_features, in_features, 32, 256, sms))
    configs = [chosen] + [
        Fp8Config(bn, 256, 4, st, s)
        for bn in (32, 64)
        for st in (3, 4)
        for s in SPLITS
        if s * 2 <= in_features // 256
    ]

    def call(weight, config):
        return fp8_w8a16_linear(x, weight, scale, dataclasses.astuple(config), counters)

    entries = timed_entries(
        call, configs, weights, reference, first.numel() + 2 * (in_features + out_features), copy_bandwidth
    )
    return layer_result(model, layer, in_features, out_features, "fp8 per channel", "fp8", entries)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "llama-3.3-70b"])
    parser.add_argument("--nf4", action="store_true", help="also the nf4 kernel (Llama-3.1-8B layers)")
    parser.add_argument("--fp8", action="store_true", help="also the fp8 kernel (Llama-3.1-8B layers)")
    parser.add_argument("--no-int4", action="store_true")
    parser.add_argument("--maxnreg", type=int, nargs="*", default=[], help="int4: also these register caps")
    parser.add_argument(
        "--rows", type=int, default=1, help="int4 and nf4: rows of x (past 1: the tensor-core kernels)"
    )
    parser.add_argument("--nf4-lookups", type=int, nargs="+", default=[3], help="nf4: code lookups to time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    sms = sm_count(torch.device("cuda"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    jobs = [(model, int4_layer, (args.maxnreg, args.rows)) for model in ([] if args.no_int4 else args.models)]
    jobs += [("llama-3.1-8b", nf4_layer, (args.nf4_lookups, args.rows))] if args.nf4 else []
    jobs += [("llama-3.1-8b", fp8_layer, ())] if args.fp8 else []
    results = []
    for model, measure, extra in jobs:
        for layer, (in_features, out_features) in shapes(model).items():
            results.append(
                measure(model, layer, in_features, out_features, sms, copy_bandwidth, generator, *extra)
            )
            torch.cuda.empty_cache()
    save_sweep("batch1_split_sweep", copy_bandwidth, sms, "layers", results, args.out)


if __name__ == "__main__":
    main()
