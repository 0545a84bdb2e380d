"""bitsandbytes nf4 GEMM times on the Llama-3.1-8B linear shapes against bf16 (cuBLAS / fitserve's dense
path) and int4 group 128, each call captured in a CUDA graph of 20 calls (launch cost excluded), median of
5 replays. Prints one JSON line per (shape, rows) with microseconds a call and the nf4 weight-streaming
bandwidth (codes + block scales over the time).

  python benchmarks/gpu/nf4_gemm.py [--rows 1,4,16,64,128,512,2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from fitserve.kernels.int4_gemm import sm_count
from fitserve.kernels.int4_repack import repack_int4
from fitserve.kernels.nf4_gemm import choose_config, nf4_linear
from fitserve.kernels.nf4_pack import pack_nf4
from fitserve.layers.linear import dense_linear
from fitserve.layers.quantization.bnb_runtime import BnbGpuLinearMethod
from fitserve.layers.quantization.bnb_weight import random_nf4_weight
from fitserve.layers.quantization.int4_cpu import FUSED_MAX_ROWS, Int4GpuLinearMethod

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CALLS = 20


def graph_time_us(run) -> float:
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def lookup_times(x: torch.Tensor, packed, rows: int) -> dict[str, float]:
    """The fused kernel with each code lookup (nf4_gemm.Nf4Config.lookup), for the rows it takes."""
    if rows > FUSED_MAX_ROWS:
        return {}
    base = choose_config(rows, packed.out_features, packed.in_features, packed.blocksize, sm_count(x.device))
    return {
        f"nf4_lookup{lookup}_us": graph_time_us(
            lambda config=replace(base, lookup=lookup): nf4_linear(x, packed, None, config)
        )
        for lookup in (0, 1, 2, 3)
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,16,64,128,512,2048")
    parser.add_argument("--out")
    args = parser.parse_args()
    layer = torch.nn.Module()
    layer.register_parameter("bias", None)
    results = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name, (k, n) in SHAPES.items():
        weight = random_nf4_weight(n, k, 64, 0.02, generator, "cuda")
        packed = pack_nf4(weight.packed, weight.absmax, weight.code, 64, torch.bfloat16)
        nf4 = BnbGpuLinearMethod(packed)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda", generator=generator)
        int4 = Int4GpuLinearMethod(
            repack_int4(codes, torch.rand(n, k // 128, device="cuda") * 0.01, torch.full((n, k // 128), 8.0,
                        device="cuda"), 128, torch.bfloat16)
        )  # fmt: skip
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            record = {
                "shape": name,
                "k": k,
                "n": n,
                "rows": rows,
                "nf4_us": graph_time_us(lambda x=x, nf4=nf4: nf4.apply(layer, x)),
                **lookup_times(x, packed, rows),
                "bf16_us": graph_time_us(lambda x=x, dense=dense: dense_linear(x, dense)),
                "int4_g128_us": graph_time_us(lambda x=x, int4=int4: int4.apply(layer, x)),
            }
            record["nf4_gb_per_s"] = packed.nbytes() / record["nf4_us"] / 1e3
            results.append(record)
            print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
