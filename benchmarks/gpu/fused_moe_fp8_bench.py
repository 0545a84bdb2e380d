"""fp8 MoE experts (layers/moe_fp8.py: one token through kernels/moe_decode.py's W8A16 kernels, more through
kernels/fused_moe_fp8.py's grouped W8A8 kernels) beside the 16-bit experts' kernels, at Qwen3-30B-A3B's
expert shape with Qwen's [128, 128] block scales (random weights, softmax routing over random logits).

For each token count T: microseconds per call from CUDA graph replays (16 calls a graph, each routed
to other experts, so at small T the weights come from HBM), for bf16 (kernels/fused_moe.py), fp8 as the
layer runs it, and fp8 W8A16 on the grouped kernels (T > 1); each checked against its torch reference
first. At T = 1: the active experts' bytes over the time, as a fraction of the copy bandwidth measured in
the same run. --sweep also times other tiles (the decode kernels' at T = 1, the grouped W8A8 kernels'
past it) to retune the defaults.

  python benchmarks/gpu/fused_moe_fp8_bench.py [--tokens 1 8 128 512 2048] [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from common import copy_bandwidth_bytes_per_s, replay_ms, save  # noqa: I001
from fused_moe_bench import CALLS_PER_GRAPH, SHAPES, build, routings

from fitserve.kernels import fused_moe as fm
from fitserve.kernels import fused_moe_fp8 as fused_moe_fp8_module
from fitserve.kernels import moe_decode
from fitserve.kernels.fused_moe_fp8 import Fp8Experts, fused_moe_fp8
from fitserve.layers.moe_fp8 import Fp8FusedExperts
from fitserve.layers.quantization.fp8_format import Fp8Format

MODEL = "qwen3-30b-a3b"
TOLERANCE = 2**-5
DECODE_TILES = [
    (32, 128, 4, 4),
    (16, 128, 4, 4),
    (64, 128, 4, 4),
    (32, 128, 4, 6),
    (32, 128, 8, 4),
    (16, 128, 2, 6),
]


def build_fp8() -> Fp8FusedExperts:
    experts, _, hidden, inter, activation = SHAPES[MODEL]
    with torch.device("cuda"):
        module = Fp8FusedExperts(
            experts, hidden, inter, activation, Fp8Format("fp8", "block", (128, 128)), MODEL
        )
    module.initialize_dummy(seed=0, std=hidden**-0.5)
    return module


def graph_us(call, routes) -> float:
    """Mean microseconds of one call(ids, weights), from CUDA graph replays over the routings."""
    call(*routes[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(*routes[i % len(routes)])
    return replay_ms(graph, 10) * 1000 / CALLS_PER_GRAPH


def checked(call, reference, routes) -> float:
    ids, weights = routes[0]
    expected = reference(ids, weights).float()
    error = ((call(ids, weights).float() - expected).abs().max() / expected.abs().max()).item()
    if error > TOLERANCE:
        raise AssertionError(f"off by {error:.4f} of the output's largest value")
    return graph_us(call, routes)


def sweep(fp8: Fp8FusedExperts, x: torch.Tensor, routes) -> list[dict]:
    """Other tiles: the decode kernels' at one token, the grouped W8A8 kernels' past it."""
    gate_up = Fp8Experts(fp8.w13, fp8.w13_scale, fp8.group_up)
    down = Fp8Experts(fp8.w2, fp8.w2_scale, fp8.group_down)
    act = fp8.kernel_activation
    reference = lambda ids, weights: fp8.reference(x, ids, weights)  # noqa: E731
    results = []
    if x.shape[0] == 1:
        for tile in DECODE_TILES:
            config = moe_decode.MoeDecodeConfig(fm.GemmTile(*tile), fm.GemmTile(*tile))
            call = lambda ids, w, c=config: moe_decode.moe_decode(x, gate_up, down, ids, w, act, 0, None, c)  # noqa: E731
            results.append({"decode_tile": tile, "graph_us": checked(call, reference, routes)})
        return results
    for block_m in (16, 32, 64):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                config = fm.FusedMoeConfig(
                    block_m,
                    fm.GemmTile(128, 128, warps, stages),
                    fm.GemmTile(128, 128, warps, 3),
                    one_program_routing=x.shape[0] <= fm.SMALL_BATCH_TOKENS,
                )
                call = lambda ids, w, c=config: fused_moe_fp8(x, gate_up, down, ids, w, act, 0, True, c)  # noqa: E731
                results.append(
                    {
                        "grouped_config": dataclasses.asdict(config),
                        "graph_us": checked(call, reference, routes),
                    }
                )
    return results


def measure(bf16, fp8: Fp8FusedExperts, tokens: int, copy_bandwidth: float, with_sweep: bool) -> dict:
    experts, top_k, hidden, inter, _ = SHAPES[MODEL]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    routes = routings(MODEL, tokens, CALLS_PER_GRAPH)
    act = bf16.kernel_activation
    entry = {"tokens": tokens}
    bf16_call = lambda ids, w: fm.fused_moe(x, bf16.gate_up_proj, bf16.down_proj, ids, w, act)  # noqa: E731
    entry["bf16_us"] = checked(bf16_call, lambda ids, w: bf16.reference(x, ids, w), routes)
    fp8_reference = lambda ids, w: fp8.reference(x, ids, w)  # noqa: E731
    entry["fp8_us"] = checked(lambda ids, w: fp8.run_kernels(x, ids, w), fp8_reference, routes)
    if tokens > 1:
        # every expert the routing touches is read once: its 3 x I x hidden weights (1 byte each in fp8)
        touched = routes[0][0].unique().numel()
        fp8_bytes = touched * 3 * inter * hidden
        entry["experts_touched"] = touched
        entry["fp8_roofline_fraction"] = fp8_bytes / (entry["fp8_us"] * 1e-6) / copy_bandwidth
        entry["bf16_roofline_fraction"] = 2 * fp8_bytes / (entry["bf16_us"] * 1e-6) / copy_bandwidth
        gate_up = Fp8Experts(fp8.w13, fp8.w13_scale, fp8.group_up)
        down = Fp8Experts(fp8.w2, fp8.w2_scale, fp8.group_down)
        w8a16 = lambda ids, w: fused_moe_fp8(x, gate_up, down, ids, w, act, 0, False)  # noqa: E731
        w8a16_reference = lambda ids, w: super(Fp8FusedExperts, fp8).reference(x, ids, w)  # noqa: E731
        entry["fp8_w8a16_us"] = checked(w8a16, w8a16_reference, routes)
    else:
        fp8_bytes = top_k * 3 * inter * hidden  # one byte a weight (the scales are 1/16,384 of it)
        entry["fp8_roofline_fraction"] = fp8_bytes / (entry["fp8_us"] * 1e-6) / copy_bandwidth
        entry["bf16_roofline_fraction"] = 2 * fp8_bytes / (entry["bf16_us"] * 1e-6) / copy_bandwidth
    if with_sweep:
        entry["sweep"] = sweep(fp8, x, routes)
        best = min(entry["sweep"], key=lambda item: item["graph_us"])
        entry["best_swept"] = best
    print(entry, flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128, 512, 2048])
    parser.add_argument(
        "--no-tma", action="store_true", help="swapped kernels read the weights by pointers, not TMA"
    )
    parser.add_argument(
        "--swap-below",
        type=int,
        default=fused_moe_fp8_module.SWAPPED_BELOW_ROWS,
        help="tiles of fewer token rows take the weights as the MMA's rows (Hopper)",
    )
    args = parser.parse_args()
    fused_moe_fp8_module.TMA_WEIGHTS = not args.no_tma
    fused_moe_fp8_module.SWAPPED_BELOW_ROWS = args.swap_below
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    bf16, fp8 = build(MODEL), build_fp8()
    results = [measure(bf16, fp8, tokens, copy_bandwidth, args.sweep) for tokens in args.tokens]
    save("fused_moe_fp8", {"copy_bandwidth_gb_per_s": copy_bandwidth / 1e9, "results": results}, args.out)


if __name__ == "__main__":
    main()
