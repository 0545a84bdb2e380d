"""Tile sweep of kernels/fp8_w8a16.py at 1 row on the Llama-3.1-8B layer shapes (per-channel scales):
microseconds per call, each a CUDA graph replayed 50 times. Prints one JSON object, best config first.

    PYTHONPATH=. python benchmarks/gpu/fp8_w8a16_sweep.py
"""

from __future__ import annotations

import itertools
import json

import torch

from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CONFIGS = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4, 6)))


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
    results = []
    operands = {}
    for name, (k, n) in SHAPES.items():
        weight = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
        scale = torch.rand(n, 1, device="cuda") + 0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        operands[name] = (x, weight, scale)
    for config in CONFIGS:
        row = {"config": config}
        try:
            for name, (x, weight, scale) in operands.items():
                call = lambda x=x, w=weight, s=scale, c=config: fp8_w8a16_linear(x, w, s, c)  # noqa: E731
                row[name] = round(timed(call), 1)
        except Exception as error:  # a tile too large for shared memory
            row["error"] = str(error).splitlines()[0][:80]
            continue
        row["total"] = round(sum(row[name] for name in SHAPES), 1)
        results.append(row)
    results.sort(key=lambda row: row["total"])
    print(json.dumps({"device": torch.cuda.get_device_name(), "best": results[:8]}, indent=1))


if __name__ == "__main__":
    main()
