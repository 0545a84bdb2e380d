"""The bitsandbytes nf4 GEMM at 1 to 8 rows: the register-fed tensor-core kernel
(fitserve/kernels/nf4_mma_gemv.py) against the kernels it replaced there (the CUDA-core kernel at 1 row,
the tl.dot kernel at 2 to 8: `nf4_gemm.MMA_DECODE = False`), against int4 group 128 (the same bytes a
weight) and bf16 cuBLAS, per Llama layer shape, as CUDA graph replays with the weights rotating through
more copies than the L2 holds (benchmarks/gpu/int4_gemm.py's timing). With --sweep it also times a grid
of launch configurations (warps, 16-row tiles per warp, split-K) and records the fastest.

  python benchmarks/gpu/nf4_mma_gemv.py [--out FILE] [--models llama-3.1-8b] [--rows 1 2 4 8] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from common import copy_bandwidth_bytes_per_s, save  # noqa: I001
from int4_gemm import check, dense_copies, packed_copies, random_packed_layer, shapes
from int4_mma_gemv import fastest, summarize, timed

from fitserve.kernels import nf4_gemm
from fitserve.kernels.int4_gemm import int4_linear
from fitserve.kernels.nf4_gemm import Nf4Config, choose_config, mma_kernel_ok, nf4_linear, sm_count
from fitserve.kernels.nf4_pack import dequantize_packed, pack_nf4
from fitserve.layers.quantization.bnb_weight import random_nf4_weight

BLOCKSIZE = 64  # bitsandbytes' default


def sweep_configs() -> list[Nf4Config]:
    return [
        Nf4Config("mma", 8, 16 * warps * tiles, 256, split, num_warps=warps)
        for warps, tiles, split in itertools.product((2, 4, 8), (1, 2), (1, 2, 4, 8, 16))
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    print(f"device-to-device copy: {copy_bandwidth / 1e9:.0f} GB/s", flush=True)
    sms = sm_count(torch.device("cuda"))
    results = []
    for model in args.models:
        for layer, (in_features, out_features) in shapes(model).items():
            generator = torch.Generator(device="cuda").manual_seed(0)
            weight = random_nf4_weight(out_features, in_features, BLOCKSIZE, 0.02, generator, "cuda")
            first = pack_nf4(weight.packed, weight.absmax, weight.code, BLOCKSIZE, torch.bfloat16)
            dequantized = dequantize_packed(first)
            packs = packed_copies(first, ("packed", "scales", "counters"))
            int4_first, _ = random_packed_layer(out_features, in_features, generator, 128)
            int4_packs = packed_copies(int4_first)
            dense = dequantized.to(torch.bfloat16)
            weights = dense_copies(dense)
            for rows in args.rows:
                x = torch.randn(rows, in_features, device="cuda", generator=generator).to(torch.bfloat16)
                assert mma_kernel_ok(x, first)
                reference = x.float() @ dequantized.T
                config = choose_config(rows, out_features, in_features, BLOCKSIZE, sms, mma=True)
                check(nf4_linear(x, first), reference, f"{model} {layer} rows {rows}")
                moved = first.nbytes() + 2 * rows * (in_features + out_features)
                entry = {"model": model, "layer": layer, "k": in_features, "n": out_features, "rows": rows}
                entry["mma_config"] = config.__dict__
                entry["bf16_us"] = timed(lambda w, x=x: F.linear(x, w), weights)
                entry["int4_g128_us"] = timed(lambda p, x=x: int4_linear(x, p), int4_packs)
                entry["mma_us"] = timed(lambda p, x=x: nf4_linear(x, p), packs)
                nf4_gemm.MMA_DECODE = False
                try:
                    previous = choose_config(rows, out_features, in_features, BLOCKSIZE, sms)
                    entry["previous_config"] = previous.__dict__
                    entry["previous_us"] = timed(lambda p, x=x: nf4_linear(x, p), packs)
                finally:
                    nf4_gemm.MMA_DECODE = True
                if args.sweep:
                    run = lambda p, c, x=x: nf4_linear(x, p, None, c)  # noqa: E731
                    fastest(entry, sweep_configs(), run, packs, reference, f"{layer} {rows}")
                summarize(entry, moved, copy_bandwidth)
                print(json.dumps(entry), flush=True)
                results.append(entry)
            del packs, int4_packs, weights, dense, dequantized, first
            torch.cuda.empty_cache()
    save(
        "nf4_mma_gemv",
        {
            "copy_bandwidth_gb_per_s": round(copy_bandwidth / 1e9, 1),
            "sm_count": sms,
            "blocksize": BLOCKSIZE,
            "timing": "CUDA graph replays of 20 calls, median (benchmarks/gpu/int4_gemm.py median_graph_us)",
            "layers": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
