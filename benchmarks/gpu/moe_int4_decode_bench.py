"""The decode-sized int4 MoE path (fitserve/kernels/moe_int4_decode.py) against the grouped int4 path
(kernels/fused_moe_int4.py grouped_moe_int4) at Qwen3-30B-A3B's expert shape (128 experts, top 8, hidden
2048, intermediate 768, groups of 128), its tensor-parallel half (384 a rank) and Qwen3.6-35B-A3B's routed
experts (256, top 8, 2048 / 512), in bfloat16 with random int4 weights.

Times are CUDA-graph replays of 16 calls, at T = 1 routed to 16 disjoint sets of experts (so the words come
from HBM, not the L2). At each T: microseconds a layer on both paths and, for the decode path, the bytes of
the chosen experts' words and scales over its time as a fraction of the copy bandwidth measured in the same
run. Every timed config is first checked against the grouped path. --sweep times the decode path's tiles
(gate_up and down BLOCK_N, warps) at each T, to choose config_for's tiles and MAX_TOKENS.

  python benchmarks/gpu/moe_int4_decode_bench.py [--out benchmarks/results/h200_moe_int4_decode.json]
      [--sweep] [--tokens 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
from common import copy_bandwidth_bytes_per_s, graph_call_ms, save  # noqa: I001

from fitserve.kernels import moe_int4_decode as md
from fitserve.kernels.fused_moe_int4 import PackedExperts, grouped_moe_int4

SHAPES = {  # experts, top_k, hidden, intermediate (this rank's), group
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
    "qwen3-30b-a3b-tp2": (128, 8, 2048, 384, 128),
    "qwen3.6-35b-a3b": (256, 8, 2048, 512, 128),
}
TOKENS = (1, 2, 4, 8, 16)
CALLS_PER_GRAPH = 16
TOLERANCE = 2**-6  # |decode - grouped| <= TOLERANCE * max|grouped|


def packed(experts: int, n: int, k: int, group: int, generator: torch.Generator) -> PackedExperts:
    padded = -(-k // 256) * 256
    words = torch.randint(-(2**31), 2**31 - 1, (experts, n, padded // 8), generator=generator, device="cuda")
    groups = padded // group
    scale = torch.rand(experts, groups, n, generator=generator, device="cuda") * 2e-3 + 1e-3
    zero = torch.full_like(scale, 8.0)
    pairs = torch.stack((scale, zero), dim=-1).to(torch.bfloat16)
    return PackedExperts(words.to(torch.int32), pairs, group, k, n)


def routings(experts: int, top_k: int, tokens: int, generator: torch.Generator):
    """CALLS_PER_GRAPH routings of T tokens; at T = 1 call i takes experts i*k .. i*k + k - 1 (mod E)."""
    result = []
    for i in range(CALLS_PER_GRAPH):
        logits = torch.randn(tokens, experts, device="cuda", generator=generator)
        if tokens == 1:
            logits[:, [(i * top_k + j) % experts for j in range(top_k)]] += 100.0
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        result.append((ids.contiguous(), (weights / weights.sum(-1, keepdim=True)).float().contiguous()))
    return result


def graph_us(call) -> float:
    """Mean microseconds of one `call(i)`, the graph's CALLS_PER_GRAPH calls taking routings 0, 1, ..."""
    index = itertools.count()
    return graph_call_ms(lambda: call(next(index) % CALLS_PER_GRAPH), CALLS_PER_GRAPH, 10) * 1000


def measure(name: str, tokens: int, configs, copy_bw: float) -> dict:
    experts, top_k, hidden, inter, group = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    gate_up = packed(experts, 2 * inter, hidden, group, generator)
    down = packed(experts, hidden, inter, group, generator)
    x = (torch.randn(tokens, hidden, device="cuda", generator=generator) * 0.5).to(torch.bfloat16)
    routes = routings(experts, top_k, tokens, generator)

    def grouped(i: int) -> torch.Tensor:
        ids, weights = routes[i]
        return grouped_moe_int4(x, gate_up, down, ids, weights, "silu")

    def decode(config):
        def call(i: int) -> torch.Tensor:
            ids, weights = routes[i]
            return md.moe_int4_decode(x, gate_up, down, ids, weights, "silu", 0, config)

        return call

    reference = grouped(0)
    scale = reference.float().abs().max().item()
    distinct = len(torch.unique(routes[0][0]))
    words = 3 * inter * hidden // 2  # gate, up and down codes, half a byte each
    per_expert = words + 4 * (2 * inter * hidden // group + hidden * inter // group)  # + (scale, zero) pairs
    row = {"model": name, "tokens": tokens, "grouped_us": graph_us(grouped), "decode": []}
    for config in configs:
        error = (decode(config)(0).float() - reference.float()).abs().max().item()
        if error > TOLERANCE * scale:
            raise AssertionError(f"{name} T={tokens} {config}: |decode - grouped| {error:.3g} vs {scale:.3g}")
        us = graph_us(decode(config))
        row["decode"].append(
            {
                "config": dataclasses.asdict(config),
                "us": us,
                "speedup": row["grouped_us"] / us,
                "roofline_fraction": distinct * per_expert / (us * 1e-6) / copy_bw,
            }
        )
    return row


def sweep_configs() -> list[md.Int4DecodeConfig]:
    grid = itertools.product((16, 32, 64), (16, 32, 64), (4, 8))
    return [
        md.Int4DecodeConfig(gate_up_block_n=gate_up, down_block_n=down, num_warps=warps)
        for gate_up, down, warps in grid
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    copy_bw = copy_bandwidth_bytes_per_s()
    results = []
    for name in args.models:
        for tokens in args.tokens:
            configs = sweep_configs() if args.sweep else [md.config_for(tokens)]
            row = measure(name, tokens, configs, copy_bw)
            best = min(row["decode"], key=lambda r: r["us"])
            row["best"] = best
            if args.sweep:
                row["decode"] = sorted(row["decode"], key=lambda r: r["us"])[:6]
            print(
                name,
                tokens,
                f"grouped {row['grouped_us']:.1f} us, decode {best['us']:.1f} us",
                best["config"],
            )
            results.append(row)
    figures = {
        "copy_bandwidth_gb_per_s": copy_bw / 1e9,
        "max_tokens": md.MAX_TOKENS,
        "default_config": dataclasses.asdict(md.DEFAULT_CONFIG),
        "single_token_config": dataclasses.asdict(md.SINGLE_TOKEN_CONFIG),
        "results": results,
    }
    save("moe_int4_decode", figures, args.out)


if __name__ == "__main__":
    main()
