"""The decode-sized MoE path (fitserve/kernels/moe_decode.py) against the grouped path (kernels/fused_moe.py
with its own tiles) at the Gemma-4 26B-A4B and Qwen3.6-35B-A3B shapes (bfloat16, random weights).

For Qwen3.6 both sides include the shared expert and its gate as the model runs them: the decode path adds
it in its two kernels; the grouped side is what the model ran before (cuBLAS gate_up, silu_and_mul, cuBLAS
down, kernels/shared_expert_gate.py). Times are CUDA-graph replays of 16 calls routed to 16 disjoint sets of
experts (so the weights come from HBM). At each T: microseconds a layer for both, and for the decode path
the bytes its slots read over its time as a fraction of the copy bandwidth measured in the same run.
Every timed moe_decode config is first checked against the torch path. --sweep times each decode kernel
alone over the same routings (gate_up at each tile; down at each tile and slot split), to choose
DEFAULT_CONFIG, and reports the best of each as a fraction of the copy bandwidth.

  python benchmarks/gpu/moe_decode_bench.py [--out benchmarks/results/h100_moe_decode.json] [--sweep]
      [--tokens 1 2 4 8 16] [--models gemma4-26b-a4b qwen3.6-35b-a3b]
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from common import replay_ms, save  # noqa: I001
from fused_moe_bench import CALLS_PER_GRAPH, DTYPE, SHAPES, measure_models, routings

from fitserve.kernels import fused_moe as fm
from fitserve.kernels import moe_decode as md
from fitserve.kernels.activation import silu_and_mul
from fitserve.kernels.shared_expert_gate import add_gated_shared_expert

TOKENS = (1, 2, 4, 8, 16)
GATE_UP_TILES = ((16, 128, 4, 4), (32, 128, 4, 4), (32, 64, 4, 6), (32, 128, 4, 3), (64, 64, 4, 4))
DOWN_TILES = ((16, 128, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4), (32, 128, 4, 3), (64, 128, 4, 3))
# the down kernel's slot splits: down_splits' choice at 2, 3 and 4 programs an SM, one slot a split, none
SPLITS = ((2, None), (3, None), (4, None), (3, 1), (3, 99))


def shared_expert(name: str) -> md.SharedExpert | None:
    if not name.startswith("qwen"):
        return None
    _, _, hidden, inter, _ = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(1)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=generator) * shape[-1] ** -0.5).to(DTYPE)

    return md.SharedExpert(weight(2 * inter, hidden), weight(hidden, inter), weight(1, hidden))


def grouped_call(module, shared: md.SharedExpert | None, config: fm.FusedMoeConfig):
    def call(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        routed = fm.fused_moe(
            x, module.gate_up_proj, module.down_proj, ids, weights, module.kernel_activation, 0, config
        )
        if shared is None:
            return routed
        mid = silu_and_mul(F.linear(x, shared.gate_up_proj), as_torch=True)
        return add_gated_shared_expert(routed, F.linear(mid, shared.down_proj), x, shared.gate_weight)

    return call


def decode_call(module, shared: md.SharedExpert | None, config: md.MoeDecodeConfig):
    def call(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        args = (x, module.gate_up_proj, module.down_proj, ids, weights, module.kernel_activation, 0)
        return md.moe_decode(*args, shared, config)

    return call


def reference(module, shared: md.SharedExpert | None, x, ids, weights) -> torch.Tensor:
    out = module.reference(x, ids, weights).float()
    if shared is not None:
        gate, up = F.linear(x, shared.gate_up_proj).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, shared.down_proj)
        out += (torch.sigmoid(F.linear(x, shared.gate_weight)) * down).float()
    return out


def checked_us(call, x, routes, expected: torch.Tensor, what: str) -> float:
    """Mean microseconds of one call from CUDA graph replays, after checking the first routing's output."""
    error = ((call(x, *routes[0]).float() - expected).abs().max() / expected.abs().max()).item()
    if error > 2**-5:
        raise AssertionError(f"{what} off by {error:.4f} of the output's largest value")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(x, *routes[i % len(routes)])
    return replay_ms(graph, 10) * 1000 / CALLS_PER_GRAPH


def graph_us(calls) -> float:
    """Mean microseconds of one of `calls` (functions of their index) from CUDA graph replays."""
    calls(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            calls(i)
    return replay_ms(graph, 10) * 1000 / CALLS_PER_GRAPH


def kernel_sweep(module, shared, x, routes) -> dict:
    """Each kernel alone over the routings: gate_up at each tile, down at each tile and slot split."""
    args = [(ids.contiguous(), weights.float().contiguous()) for ids, weights in routes]
    activation = module.kernel_activation
    gate_up = []
    for fields in GATE_UP_TILES:
        tile = md.GemmTile(*fields)

        def gate_up_call(i: int, tile: md.GemmTile = tile) -> torch.Tensor:
            return md.decode_gate_up(x, module.gate_up_proj, args[i][0], activation, 0, shared, tile)

        gate_up.append({"tile": fields, "us": graph_us(gate_up_call)})
    tile = md.DEFAULT_CONFIG.gate_up
    mids = [md.decode_gate_up(x, module.gate_up_proj, ids, activation, 0, shared, tile) for ids, _ in args]
    down = []
    for fields in DOWN_TILES:
        for per_sm, per_split in SPLITS:
            config = md.MoeDecodeConfig(md.DEFAULT_CONFIG.gate_up, md.GemmTile(*fields), per_sm, per_split)

            def down_call(i: int, config: md.MoeDecodeConfig = config) -> torch.Tensor:
                ids, weights = args[i]
                return md.decode_down(mids[i], x, module.down_proj, ids, weights, 0, shared, config)

            down.append(
                {
                    "tile": fields,
                    "programs_per_sm": per_sm,
                    "slots_per_split": per_split,
                    "us": graph_us(down_call),
                }
            )
    return {
        "gate_up": gate_up,
        "down": down,
        "best_gate_up": min(gate_up, key=lambda e: e["us"]),
        "best_down": min(down, key=lambda e: e["us"]),
    }


def measure(name: str, module, tokens: int, copy_bandwidth: float, sweep: bool) -> dict:
    experts, top_k, hidden, inter, _ = SHAPES[name]
    shared = shared_expert(name)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    routes = routings(name, tokens, CALLS_PER_GRAPH)
    expected = reference(module, shared, x, *routes[0])
    grouped = fm.choose_config(tokens, hidden, inter, top_k, experts)
    entry = {"model": name, "tokens": tokens, "shared_expert": shared is not None}
    entry["grouped_us"] = checked_us(grouped_call(module, shared, grouped), x, routes, expected, "grouped")
    config = md.DEFAULT_CONFIG
    entry["decode_us"] = checked_us(decode_call(module, shared, config), x, routes, expected, "decode")
    entry["decode_speedup"] = entry["grouped_us"] / entry["decode_us"]
    slots = tokens * top_k + (tokens if shared is not None else 0)  # upper bound: slots may share experts
    slot_bytes = slots * 3 * inter * hidden * DTYPE.itemsize
    entry["slot_bytes"] = slot_bytes
    entry["decode_roofline_fraction"] = slot_bytes / (entry["decode_us"] * 1e-6) / copy_bandwidth
    if sweep:
        entry["kernels"] = kernel_sweep(module, shared, x, routes)
        gate_up_bytes = slots * 2 * inter * hidden * DTYPE.itemsize
        for kernel, nbytes in (("gate_up", gate_up_bytes), ("down", slot_bytes - gate_up_bytes)):
            best = entry["kernels"][f"best_{kernel}"]
            best["roofline_fraction"] = nbytes / (best["us"] * 1e-6) / copy_bandwidth
    print(entry, flush=True)
    return entry


def main() -> None:
    args, copy_bandwidth, results = measure_models(__doc__.splitlines()[0], TOKENS, measure)
    summary = {
        "copy_bandwidth_gb_per_s": copy_bandwidth / 1e9,
        "max_tokens": md.MAX_TOKENS,
        "max_tokens_with_shared": md.MAX_TOKENS_WITH_SHARED,
    }
    save(
        "moe_decode",
        {**summary, "default_config": dataclasses.asdict(md.DEFAULT_CONFIG), "results": results},
        args.out,
    )


if __name__ == "__main__":
    main()
