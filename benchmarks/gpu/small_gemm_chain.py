"""Is a PDL-launched Triton GEMM worth writing for small models' decode steps? A measurement, not a kernel
fitserve uses.

nano's decode steps (Qwen3-0.6B shape, 32 to 256 rows) spend 1.5 to 2.4 ms outside attention; at 128
rows cuBLAS's four GEMMs a layer took ~30 us against ~10 us to read their 31 MB of weights, and cuBLAS
kernels are not launched with programmatic dependent launch, so every one of them waits for the kernel
before it to finish and then for its own launch. This script times the 28 layers' four GEMMs as one
CUDA graph (each GEMM reads the previous one's output, weights distinct per layer, so none stay in the
L2), once with F.linear (cuBLAS) and once with the plain Triton GEMM below launched with PDL
(fitserve.kernels.dependent_launch), over a few tile shapes and split-K factors for the narrow
weights, at several row counts. Each variant is checked against F.linear on the first layer.

  python benchmarks/gpu/small_gemm_chain.py [--model qwen3-0.6b] [--out ...]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import copy_bandwidth_bytes_per_s, graph_call_ms, save  # noqa: I001
from skinny_gemm import shapes

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel

ROWS = (32, 64, 128, 256)
SPLIT_TILE = (64, 32, 128, 4, 4)
TILES = [
    (32, 64, 128, 4, 3),
    (64, 64, 128, 4, 3),
    (64, 32, 128, 4, 4),
    (128, 64, 64, 8, 3),
    (64, 128, 64, 4, 3),
]


@triton.jit
def _gemm_split_k_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counters_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = x @ w.T. With SPLIT_K > 1 each program sums K / SPLIT_K of the products into a float32
    partial, and the last of a tile's SPLIT_K programs to arrive (an atomic counter it resets) adds the
    partials in split order."""
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    ks = tl.arange(0, BLOCK_K)
    k_per_split = K // SPLIT_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k + ks)[None, :], mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + (k + ks)[None, :], mask=cols[:, None] < N, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    num_tiles = tl.num_programs(0) * tl.num_programs(1)
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(part_ptr + (split * num_tiles + tile) * (BLOCK_M * BLOCK_N) + offsets, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for part in range(SPLIT_K):
            block = part_ptr + (part * num_tiles + tile) * (BLOCK_M * BLOCK_N) + offsets
            total += tl.load(block, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)


_WORKSPACE: dict[str, torch.Tensor] = {}


def triton_linear(
    x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int, int, int], split_k: int = 1
) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    if "counters" not in _WORKSPACE:
        _WORKSPACE["counters"] = torch.zeros(1 << 16, dtype=torch.int32, device=x.device)
        _WORKSPACE["partials"] = torch.empty(64 << 20, dtype=torch.uint8, device=x.device).view(torch.float32)
    partials, counters = _WORKSPACE["partials"], _WORKSPACE["counters"]
    _gemm_split_k_kernel[(*grid, split_k)](
        x, w, out, partials, counters, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=warps, num_stages=stages, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out


def split_for(w: torch.Tensor, split_k: int) -> int:
    """Split K only for the narrow weights (Qwen3-0.6B's o and down: 1,024 outputs), whose few tiles
    leave most SMs idle."""
    return split_k if w.shape[0] <= 2048 else 1


def chain(x: torch.Tensor, layers: list[dict[str, torch.Tensor]], linear) -> torch.Tensor:
    """Each layer: qkv, o (on the first q columns), gate_up, down (on the first half): the GEMMs' shapes
    and order in a decoder layer, each reading the one before's output."""
    for weights in layers:
        qkv = linear(x, weights["qkv"])
        hidden = linear(qkv[:, : weights["o"].shape[1]], weights["o"])  # strided views: no copy kernels
        gate_up = linear(hidden, weights["gate_up"])
        x = linear(gate_up[:, : weights["down"].shape[1]], weights["down"])
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    dims = {name: shape for name, shape in shapes(args.model).items() if name != "lm_head"}
    layers = [
        {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02 for name, shape in dims.items()}
        for _ in range(args.layers)
    ]
    weight_bytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    copy = copy_bandwidth_bytes_per_s()
    rows_out = []
    variants = (
        [(None, 1)] + [(tile, 1) for tile in TILES] + [(SPLIT_TILE, 2), (SPLIT_TILE, 4), (SPLIT_TILE, 8)]
    )
    for rows, (tile, split_k) in itertools.product(ROWS, variants):
        x = torch.randn(rows, dims["qkv"][1], device="cuda", dtype=torch.bfloat16)
        if tile is None:
            ms = graph_call_ms(lambda x=x: chain(x, layers, F.linear))
        else:

            def linear(a, w, tile=tile, split_k=split_k):
                return triton_linear(a, w, tile, split_for(w, split_k))

            expected = chain(x, layers[:1], F.linear)
            got = chain(x, layers[:1], linear)
            error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
            assert error < 2e-2, f"tile {tile} split {split_k}: relative error {error:.3g} against F.linear"
            ms = graph_call_ms(lambda x=x, linear=linear: chain(x, layers, linear))
        rows_out.append(
            {
                "rows": rows,
                "gemm": "cuBLAS (F.linear)" if tile is None else "Triton, PDL",
                "tile_m_n_k_warps_stages": tile,
                "split_k_of_narrow_weights": split_k,
                "us_per_layer": round(ms * 1e3 / args.layers, 2),
                "weight_read_fraction_of_copy_bandwidth": round(weight_bytes / (ms * 1e-3) / copy, 3),
            }
        )
        print(rows_out[-1], flush=True)
    save(
        f"small_gemm_chain_{args.model}",
        {
            "layers": args.layers,
            "weight_bytes": weight_bytes,
            "copy_bandwidth_gbs": round(copy / 1e9, 1),
            "runs": rows_out,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
