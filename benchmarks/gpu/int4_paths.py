"""The GPU int4 layer's two paths against bf16 F.linear, by rows of x: the fused W4A16 kernels
(kernels/int4_gemm.py) and dequantize-by-chunks + cuBLAS (kernels/int4_dequant.py, 64 MiB and 16 MiB of
scratch); Llama-3.1-8B's four layers at group 128, triton's do_bench (median, us). The crossover sets
layers/quantization/int4_cpu.py's FUSED_MAX_ROWS.
  python benchmarks/gpu/int4_paths.py [--out FILE]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from common import save  # noqa: I001
from triton.testing import do_bench

from fitserve.kernels.int4_dequant import chunk_rows, chunked_int4_linear, dequantize_rows, scratch_buffer
from fitserve.kernels.int4_gemm import int4_linear
from fitserve.kernels.int4_repack import repack_int4

LAYERS = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)}
ROWS = (16, 32, 48, 64, 128, 256, 1024, 4096)


def time_layer(k: int, n: int) -> dict:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = 0.01 * torch.rand(n, k // 128, device="cuda")
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda").float()
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    chunk = chunk_rows(n, k, 2)
    scratch = scratch_buffer(torch.device("cuda", 0), torch.bfloat16)[: chunk * k].view(chunk, k)
    figures = {"k": k, "n": n, "dequant_chunk_rows": chunk, "rows": {}}
    dequant = partial(dequantize_rows, packed, 0, chunk, scratch)
    figures["dequant_chunk_us"] = round(1e3 * do_bench(dequant), 1)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        calls = {
            "fused_us": partial(int4_linear, x, packed),
            "chunked_64mib_us": partial(chunked_int4_linear, x, packed),
            "bf16_us": partial(F.linear, x, weight),
            "chunked_16mib_us": partial(chunked_int4_linear, x, packed, scratch_bytes=16 << 20),
        }
        figures["rows"][m] = {key: round(1e3 * do_bench(call), 1) for key, call in calls.items()}
        print(k, n, m, figures["rows"][m], flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    save("int4_paths", {name: time_layer(k, n) for name, (k, n) in LAYERS.items()}, args.out)


if __name__ == "__main__":
    main()
