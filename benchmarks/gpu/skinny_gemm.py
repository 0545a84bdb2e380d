"""Decode-step linear layers on the GPU: cuBLAS against fitserve's skinny_gemm (1 to 16 rows) and
swapped_gemm (17 to 32 rows) kernels.

For each weight shape of the Llama-3.1-8B and Qwen3-0.6B shapes (qkv, o, gate_up, down, lm_head; a
Qwen3.5/3.6 hybrid's DeltaNet and full-attention projections with --models qwen3.6-27b) and each row
count, times F.linear (cuBLAS, and cuBLASLt) and skinny_gemm over a sweep of tile configs (or
swapped_gemm's one tile past 16 rows), each call reading its weight from HBM (the weights rotate through
more copies than the L2 holds; timed as CUDA graph replays, so no launch cost counts). Prints and saves
the time, the bandwidth (weight bytes / time) and its fraction of the device-to-device copy bandwidth
measured in the same run.

  python benchmarks/gpu/skinny_gemm.py [--out benchmarks/results/h100_skinny_gemm.json] [--quick]
      [--rows 1 4 8 16] [--models llama-3.1-8b qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
from common import MODELS, copy_bandwidth_bytes_per_s, replay_ms, save  # noqa: I001

from fitserve.kernels.skinny_gemm import DEFAULT_CONFIG, MAX_ROWS, SkinnyGemmConfig, skinny_gemm
from fitserve.kernels.swapped_gemm import supports as swapped_supports
from fitserve.kernels.swapped_gemm import swapped_gemm

ROWS = (1, 4, 8, 16)  # the rows skinny_gemm takes (MAX_ROWS)
L2_BYTES_TO_BEAT = 256 << 20  # rotate through at least this many weight bytes
CALLS_PER_GRAPH = 20


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """Layer name -> (out_features, in_features) from the shape's config.json."""
    config = json.loads((MODELS / model / "config.json").read_text())
    config = config.get("text_config", config)  # a multimodal checkpoint's language model
    if "linear_num_value_heads" in config:
        return hybrid_shapes(config)
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config["num_key_value_heads"]
    inter = config["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def hybrid_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """A Qwen3.5/3.6 hybrid's (dense) decode linears: its DeltaNet layers' in_proj_qkv, in_proj_z and
    out_proj, its full layers' q_proj (query and gate) and o_proj, the MLP and the LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    query = config["num_attention_heads"] * config["head_dim"]
    return {
        "in_proj_qkv": (2 * key + value, hidden),
        "in_proj_z": (value, hidden),
        "out_proj": (hidden, value),
        "q_gate": (2 * query, hidden),
        "o": (hidden, query),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (config["vocab_size"], hidden),
    }


def time_us(call, weights: list[torch.Tensor]) -> float:
    """Mean microseconds of one call, from CUDA graph replays cycling through `weights`."""
    for weight in weights[:2]:
        call(weight)  # compile / pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            call(weights[i % len(weights)])
    return replay_ms(graph, 10) * 1000 / CALLS_PER_GRAPH


def sweep(quick: bool) -> list[SkinnyGemmConfig]:
    if quick:
        return []
    return [
        SkinnyGemmConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
        for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5))
    ]


def check(result: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    error = (result.float() - reference).abs().max().item()
    if error > 0.05 * reference.abs().max().item() + 1e-2:
        raise AssertionError(f"{what}: max error {error}")


def add_fractions(entry: dict, weight_bytes: int, bandwidth: float) -> None:
    """Each timing's fraction of the copy bandwidth, then prints the entry."""
    for key in [k[: -len("_us")] for k in entry if k.endswith("_us")]:
        achieved = weight_bytes / (entry[f"{key}_us"] * 1e-6)
        entry[f"{key}_copy_bw_frac"] = round(achieved / bandwidth, 3)
    print(json.dumps(entry), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="Only the default config, no sweep.")
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=list(ROWS), help="rows of x (1 to 32 for the kernels)"
    )
    args = parser.parse_args()
    bandwidth = copy_bandwidth_bytes_per_s()
    results = []
    for model in args.models:
        for layer, (out_features, in_features) in shapes(model).items():
            weight_bytes = out_features * in_features * 2
            copies = max(2, -(-L2_BYTES_TO_BEAT // weight_bytes))
            weights = [
                torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
                for _ in range(copies)
            ]
            for rows in args.rows:
                x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
                reference = F.linear(x, weights[0]).float()
                entry = {"model": model, "layer": layer, "rows": rows, "n": out_features, "k": in_features}
                torch.backends.cuda.preferred_blas_library("cublas")
                entry["cublas_us"] = time_us(lambda w, x=x: F.linear(x, w), weights)
                torch.backends.cuda.preferred_blas_library("cublaslt")
                entry["cublaslt_us"] = time_us(lambda w, x=x: F.linear(x, w), weights)
                torch.backends.cuda.preferred_blas_library("cublas")
                if rows > MAX_ROWS:
                    if swapped_supports(x, weights[0]):
                        check(swapped_gemm(x, weights[0]), reference, f"{model} {layer} rows {rows}")
                        entry["swapped_us"] = time_us(lambda w, x=x: swapped_gemm(x, w), weights)
                    add_fractions(entry, weight_bytes, bandwidth)
                    results.append(entry)
                    continue
                default = DEFAULT_CONFIG
                timed = {}
                for config in [default, *sweep(args.quick)]:
                    if config in timed:
                        continue
                    try:
                        result = skinny_gemm(x, weights[0], config=config)
                    except triton.runtime.errors.OutOfResources:
                        continue  # the tile needs more shared memory than this GPU has
                    check(result, reference, f"{model} {layer} rows {rows} {config}")
                    timed[config] = time_us(lambda w, x=x, c=config: skinny_gemm(x, w, config=c), weights)
                best = min(timed, key=timed.get)
                entry["skinny_default_us"] = timed[default]
                entry["skinny_best_us"] = timed[best]
                entry["skinny_best_config"] = best.__dict__
                add_fractions(entry, weight_bytes, bandwidth)
                results.append(entry)
            del weights
            torch.cuda.empty_cache()
    save(
        "skinny_gemm",
        {"copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1), "layers": results},
        args.out,
    )


if __name__ == "__main__":
    main()
