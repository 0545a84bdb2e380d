"""The fused MoE kernels (fitserve/kernels/fused_moe.py) against FusedExperts' torch loop, at the Gemma-4
26B-A4B and Qwen3.6-35B-A3B expert shapes (bfloat16, random weights, softmax routing over random logits).

For each shape and token count T: the kernel's time per call (CUDA graph replays, so no launch cost; each
call of the graph routes to other experts, so at small T the weights come from HBM, not from the L2), the
same eagerly (launches included), the torch loop's eager time (it syncs with the host, so no graph), and
the sum kernel's share. At T = 1: the bytes of the k active experts' weights over the kernel's time, and
that bandwidth's fraction of the device-to-device copy bandwidth measured in the same run (the roofline
fraction). Each timing is checked against the torch path first. --sweep also times other tiles at each T
(the default config's tiles marked), to retune choose_config.

  python benchmarks/gpu/fused_moe_bench.py [--out benchmarks/results/h100_fused_moe.json] [--sweep]
      [--tokens 1 8 64 512 4096] [--models gemma4-26b-a4b qwen3.6-35b-a3b]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F
from common import copy_bandwidth_bytes_per_s, replay_ms, save  # noqa: I001

from fitserve.kernels import fused_moe as fm
from fitserve.layers.moe import FusedExperts

SHAPES = {  # experts, top_k, hidden, moe_intermediate, activation
    "gemma4-26b-a4b": (128, 8, 2816, 704, lambda x: F.gelu(x, approximate="tanh")),
    "qwen3.6-35b-a3b": (256, 8, 2048, 512, F.silu),
    "qwen3-30b-a3b": (128, 8, 2048, 768, F.silu),  # fused_moe_fp8_bench.py's shape
}
TOKENS = (1, 8, 64, 512, 4096)
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 16  # at T = 1 the 16 calls route to 16 disjoint sets of k experts
EAGER_REPEATS = 10


def build(name: str) -> FusedExperts:
    experts, _, hidden, inter, activation = SHAPES[name]
    module = FusedExperts(experts, hidden, inter, activation)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for param, fan_in in ((module.gate_up_proj, hidden), (module.down_proj, inter)):
        shape = param.shape
        param.data = (torch.randn(shape, device="cuda", generator=generator) * fan_in**-0.5).to(DTYPE)
    return module


def routings(name: str, tokens: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` routings of T tokens; at T = 1 call i takes experts i*k .. i*k + k - 1 (mod E) most."""
    experts, top_k = SHAPES[name][:2]
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    result = []
    for i in range(count):
        logits = torch.randn(tokens, experts, device="cuda", generator=generator)
        if tokens == 1:
            chosen = [(i * top_k + j) % experts for j in range(top_k)]
            logits[:, chosen] += 100.0
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        result.append((ids, weights / weights.sum(dim=-1, keepdim=True)))
    return result


def graph_us(module: FusedExperts, x: torch.Tensor, routes, config) -> float:
    """Mean microseconds of one fused_moe call, from CUDA graph replays over the routings."""

    def call(i: int) -> torch.Tensor:
        ids, weights = routes[i % len(routes)]
        return fm.fused_moe(
            x, module.gate_up_proj, module.down_proj, ids, weights, module.kernel_activation, 0, config
        )

    call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(i)
    return replay_ms(graph, 10) * 1000 / CALLS_PER_GRAPH


def eager_us(call) -> float:
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(EAGER_REPEATS):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / EAGER_REPEATS * 1e6


def sum_kernel_us(tokens: int, top_k: int, hidden: int, local_experts: int) -> float:
    """The last kernel alone (per-pair rows summed per token), from graph replays."""
    per_pair = torch.randn(tokens * top_k, hidden, device="cuda").to(DTYPE)
    ids = torch.zeros(tokens, top_k, dtype=torch.int64, device="cuda")
    out = torch.empty(tokens, hidden, dtype=DTYPE, device="cuda")
    args = (per_pair, ids, out, hidden, 0, local_experts, per_pair.stride(0), out.stride(0))

    def call() -> None:
        grid = (tokens, fm.cdiv(hidden, fm.SUM_BLOCK))
        fm._launch(fm._moe_sum_kernel, grid, args, {"TOP_K": top_k, "BLOCK": fm.SUM_BLOCK}, out.device, 4)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    return replay_ms(graph, 10) * 1000 / CALLS_PER_GRAPH


def check(module: FusedExperts, x: torch.Tensor, ids, weights, config) -> float:
    weights_of_layer = (module.gate_up_proj, module.down_proj)
    out = fm.fused_moe(x, *weights_of_layer, ids, weights, module.kernel_activation, 0, config)
    reference = module.reference(x, ids, weights).float()
    error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
    if error > 2**-5:
        raise AssertionError(f"fused_moe off by {error:.4f} of the output's largest value ({config})")
    return error


def sweep_configs(base: fm.FusedMoeConfig) -> list[fm.FusedMoeConfig]:
    small = base.block_m == 16
    gate_up = [(n, k) for n in (16, 32, 64) for k in (64, 128, 256)]
    if not small:
        gate_up = [(64, 64), (128, 64), (64, 32)]
    down = [(n, k) for n in (32, 64, 128) for k in (64, 128)] if small else [(128, 64), (64, 64), (256, 64)]
    configs = [dataclasses.replace(base, gate_up=fm.GemmTile(n, k, 4, 4)) for n, k in gate_up]
    configs += [dataclasses.replace(base, down=fm.GemmTile(n, k, 4 if n < 128 else 8, 4)) for n, k in down]
    if not small:  # tile rows: at 128 tokens over 128 experts an expert gets ~8 pairs (fp8's best: 16)
        configs += [dataclasses.replace(base, block_m=rows) for rows in (128, 32, 16)]
    return [c for c in dict.fromkeys(configs) if c != base]


def measure(name: str, module: FusedExperts, tokens: int, copy_bandwidth: float, sweep: bool) -> dict:
    experts, top_k, hidden, inter, _ = SHAPES[name]
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    routes = routings(name, tokens, CALLS_PER_GRAPH)
    config = fm.choose_config(tokens, hidden, inter, top_k, experts)
    ids, weights = routes[0]
    entry = {
        "model": name,
        "tokens": tokens,
        "config": dataclasses.asdict(config),
        "max_error": check(module, x, ids, weights, config),
        "kernel_graph_us": graph_us(module, x, routes, config),
        "kernel_eager_us": eager_us(lambda: module(x, ids, weights, reduce=False)),
        "torch_loop_eager_us": eager_us(lambda: module.reference(x, ids, weights)),
        "sum_kernel_us": sum_kernel_us(tokens, top_k, hidden, experts),
    }
    entry["speedup_vs_torch_loop"] = entry["torch_loop_eager_us"] / entry["kernel_graph_us"]
    entry["sum_kernel_share"] = entry["sum_kernel_us"] / entry["kernel_graph_us"]
    if tokens == 1:
        active_bytes = top_k * 3 * inter * hidden * DTYPE.itemsize
        bandwidth = active_bytes / (entry["kernel_graph_us"] * 1e-6)
        entry["active_expert_bytes"] = active_bytes
        entry["achieved_gb_per_s"] = bandwidth / 1e9
        entry["roofline_fraction"] = bandwidth / copy_bandwidth
    if sweep:
        entry["sweep"] = []
        for candidate in sweep_configs(config):
            check(module, x, ids, weights, candidate)
            timing = graph_us(module, x, routes, candidate)
            entry["sweep"].append({"config": dataclasses.asdict(candidate), "graph_us": timing})
        best = min(entry["sweep"], key=lambda item: item["graph_us"])
        entry["best_swept_us"] = best["graph_us"]
        entry["best_swept_config"] = best["config"]
    print(entry, flush=True)
    torch.cuda.empty_cache()
    return entry


def measure_models(
    description: str, tokens: tuple[int, ...], measure
) -> tuple[argparse.Namespace, float, list]:
    """The command line both MoE benchmarks take (--out, --sweep, --tokens, --models) and
    measure(name, module, tokens, copy_bandwidth, sweep) over each model and token count, one model's
    weights on the GPU at a time: (the arguments, the copy bandwidth measured, the entries)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(tokens))
    parser.add_argument("--models", nargs="+", default=list(SHAPES)[:2], choices=list(SHAPES))
    args = parser.parse_args()
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    results = []
    for name in args.models:
        module = build(name)
        results += [measure(name, module, count, copy_bandwidth, args.sweep) for count in args.tokens]
        del module
        torch.cuda.empty_cache()
    return args, copy_bandwidth, results


def main() -> None:
    args, copy_bandwidth, results = measure_models(__doc__.splitlines()[0], TOKENS, measure)
    save("fused_moe", {"copy_bandwidth_gb_per_s": copy_bandwidth / 1e9, "results": results}, args.out)


if __name__ == "__main__":
    main()
