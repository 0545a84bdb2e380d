"""fp8 linear paths against bf16 F.linear at the Llama-3.1-8B layer shapes (CUDA): microseconds per call,
each call captured in a CUDA graph (as the engine's decode steps run) and replayed 50 times, timed with
CUDA events after 10 warm-up replays. Prints one JSON object.

    python benchmarks/fp8_linear_bench.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

import fitserve.layers.quantization.fp8_compute as fp8_compute
from fitserve.layers.quantization.fp8_weight import random_fp8_weight

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = (1, 16, 64, 256, 1024, 4096)


def timed(fn) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 50


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for name, (k, n) in SHAPES.items():
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        layers = {}
        for path, group in (("w8a8", None), ("w8a8-block", 128)):
            weight = random_fp8_weight(n, k, group, 0.02, generator, "cuda")
            if group:
                weight.scale = weight.scale[::128].repeat_interleave(128, 0).contiguous()
            layer = nn.Module()
            layer.bias = None
            method = fp8_compute.make_fp8_runnable(
                layer, weight, None, torch.bfloat16, "dynamic", "bench", torch.device("cuda")
            )
            assert method.path == path, method.path
            layers[path] = (layer, method)
        supported = fp8_compute.w8a8_supported
        fp8_compute.w8a8_supported = lambda device: False
        layer = nn.Module()
        layer.bias = None
        weight = random_fp8_weight(n, k, None, 0.02, generator, "cuda")
        layers["weight-only"] = (
            layer,
            fp8_compute.make_fp8_runnable(
                layer, weight, None, torch.bfloat16, "dynamic", "bench", torch.device("cuda")
            ),
        )
        fp8_compute.w8a8_supported = supported
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"bf16": timed(lambda x=x, w=w_bf16: F.linear(x, w))}
            for path, (layer, method) in layers.items():
                row[path] = timed(lambda layer=layer, method=method, x=x: method.apply(layer, x))
            results[f"{name}_m{rows}"] = {key: round(value, 1) for key, value in row.items()}
    print(json.dumps({"device": torch.cuda.get_device_name(), "us_per_call": results}, indent=1))


if __name__ == "__main__":
    main()
