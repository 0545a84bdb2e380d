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

With --split: the weights below skinny_gemm's 4,096 output features of Qwen3.6-35B-A3B, Gemma-4 26B-A4B and
Llama-3.1-8B (router, shared expert, o_proj / out_proj, k / v, down; `small_shapes`), cuBLAS against
skinny_split_gemm in each of --split-configs (kernels/skinny_split_gemm.CONFIGS; K split by its
choose_splits), side by side; `routed` says whether layers/linear.py sends the weight there
(takes_weight). --split-prefetch-steps sets its L2 prefetch (0: off); --no-pdl launches every Triton kernel
without programmatic dependent launch.

  python benchmarks/gpu/skinny_gemm.py --split [--split-configs n32k256 n16k256 n32k128 n64k128x2]
      [--rows 1 4 8 16] [--out benchmarks/results/h100_skinny_split_gemm.json]

With --tp-shapes: one rank's dense decode linears at tensor-parallel sizes --tp-sizes (column-parallel qkv
and gate_up split N, row-parallel o and down split K) of --models (default Llama-3.1-8B, Llama-3.3-70B,
Qwen3-8B): cuBLAS, skinny_gemm's two tiles and skinny_split_gemm at its chosen splits and at 2 and 4, with
`routed`, the kernel layers/linear.py picks today.

  python benchmarks/gpu/skinny_gemm.py --tp-shapes [--tp-sizes 1 2 4] [--rows 1 4 8 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
from common import MODELS, copy_bandwidth_bytes_per_s, replay_ms, save  # noqa: I001

from fitserve.kernels import dependent_launch
from fitserve.kernels import skinny_split_gemm as split_module
from fitserve.kernels.skinny_gemm import DEFAULT_CONFIG, MAX_ROWS, SkinnyGemmConfig, skinny_gemm
from fitserve.kernels.skinny_gemm import MIN_OUT_FEATURES as SKINNY_MIN_OUT_FEATURES
from fitserve.kernels.swapped_gemm import supports as swapped_supports
from fitserve.kernels.swapped_gemm import swapped_gemm

ROWS = (1, 4, 8, 16)  # the rows skinny_gemm takes (MAX_ROWS)
L2_BYTES_TO_BEAT = 256 << 20  # rotate through at least this many weight bytes
CALLS_PER_GRAPH = 20
SPLIT_MODELS = ("qwen3.6-35b-a3b", "gemma-4-26b-a4b-it", "llama-3.1-8b")


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


def small_shapes(model: str) -> dict[str, tuple[int, int]]:
    """Layer names -> (out_features, in_features) of a model's decode linears below skinny_gemm's 4,096 rows
    (one entry per shape, its layers' names joined): k / v and o projections (Gemma-4's global layers'
    too), the MLP's or shared expert's, the MoE router, a DeltaNet's out_proj."""
    config = json.loads((MODELS / model / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    found = {"k / v": (config["num_key_value_heads"] * head_dim, hidden), "o": (hidden, heads * head_dim)}
    if "global_head_dim" in config:
        global_dim = config["global_head_dim"]
        found["k / v global"] = (config["num_global_key_value_heads"] * global_dim, hidden)
        found["o global"] = (hidden, heads * global_dim)
    if "intermediate_size" in config:
        found["gate_up"] = (2 * config["intermediate_size"], hidden)
        found["down"] = (hidden, config["intermediate_size"])
    if "num_experts" in config:
        found["router"] = (config["num_experts"], hidden)
    if "shared_expert_intermediate_size" in config:
        found["shared gate_up"] = (2 * config["shared_expert_intermediate_size"], hidden)
        found["shared down"] = (hidden, config["shared_expert_intermediate_size"])
    if "linear_num_value_heads" in config:
        found["out_proj"] = (hidden, config["linear_num_value_heads"] * config["linear_value_head_dim"])
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, shape in found.items():
        if shape[0] < SKINNY_MIN_OUT_FEATURES:  # every weight skinny_gemm leaves, taken or not
            by_shape.setdefault(shape, []).append(name)
    return {" + ".join(names): shape for shape, names in by_shape.items()}


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
        entry[f"{key}_gb_per_s"] = round(achieved / 1e9, 1)
        entry[f"{key}_copy_bw_frac"] = round(achieved / bandwidth, 3)
    print(json.dumps(entry), flush=True)


def split_entries(models: list[str], rows_list: list[int], names: list[str], bandwidth: float) -> list[dict]:
    """cuBLAS against skinny_split_gemm in each named config, per small weight and row count."""
    results = []
    for model in models:
        for layer, (out_features, in_features) in small_shapes(model).items():
            weight_bytes = out_features * in_features * 2
            copies = max(2, -(-L2_BYTES_TO_BEAT // weight_bytes))
            weights = [
                torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
                for _ in range(copies)
            ]
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            for rows in rows_list:
                x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
                reference = F.linear(x, weights[0]).float()
                entry = {"model": model, "layer": layer, "rows": rows, "n": out_features, "k": in_features}
                entry["routed"] = split_module.takes_weight(out_features, in_features)
                entry["cublas_us"] = time_us(lambda w, x=x: F.linear(x, w), weights)
                for name in names:
                    config = split_module.CONFIGS[name]
                    result = split_module.skinny_split_gemm(x, weights[0], config=config)
                    check(result, reference, f"{model} {layer} rows {rows} {name}")
                    entry[f"split_{name}_splits"] = split_module.choose_splits(
                        out_features, in_features, config, sms
                    )
                    entry[f"split_{name}_us"] = time_us(
                        lambda w, x=x, c=config: split_module.skinny_split_gemm(x, w, config=c), weights
                    )
                add_fractions(entry, weight_bytes, bandwidth)
                results.append(entry)
            del weights
            torch.cuda.empty_cache()
    return results


TP_MODELS = ("llama-3.1-8b", "llama-3.3-70b", "qwen3-8b")


def tp_shapes(model: str, tp_size: int) -> dict[str, tuple[int, int]]:
    """One rank's qkv / o / gate_up / down at tensor-parallel size tp_size (KV heads split, or one a rank
    when there are fewer than ranks)."""
    config = json.loads((MODELS / model / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = max(1, config["num_key_value_heads"] // tp_size)
    inter = config["intermediate_size"] // tp_size
    return {
        "qkv": ((heads // tp_size + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads // tp_size * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def routed_kernel(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The kernel layers/linear.dense_linear gives this call."""
    from fitserve.kernels import skinny_gemm as skinny_module

    if skinny_module.worth_it(x, weight):
        return "skinny"
    if split_module.worth_it(x, weight):
        return "split"
    return "cublas"


def tp_entries(models: list[str], tp_sizes: list[int], rows_list: list[int], bandwidth: float) -> list[dict]:
    """Per rank's weight and row count: cuBLAS, skinny_gemm (default and narrow tile), skinny_split_gemm
    (n32k256 at its chosen splits, at 2 and 4, and n16k256 at its chosen splits)."""
    from fitserve.kernels.skinny_gemm import NARROW_CONFIG

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seen = set()
    results = []
    for model, tp_size in itertools.product(models, tp_sizes):
        for layer, (out_features, in_features) in tp_shapes(model, tp_size).items():
            if (out_features, in_features) in seen:
                continue
            seen.add((out_features, in_features))
            weight_bytes = out_features * in_features * 2
            copies = max(2, -(-L2_BYTES_TO_BEAT // weight_bytes))
            weights = [
                torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
                for _ in range(copies)
            ]
            for rows in rows_list:
                x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
                reference = F.linear(x, weights[0]).float()
                entry = {"model": model, "tp": tp_size, "layer": layer, "rows": rows}
                entry |= {"n": out_features, "k": in_features, "routed": routed_kernel(x, weights[0])}
                entry["cublas_us"] = time_us(lambda w, x=x: F.linear(x, w), weights)
                for name, config in (("skinny", DEFAULT_CONFIG), ("skinny_narrow", NARROW_CONFIG)):
                    check(skinny_gemm(x, weights[0], config=config), reference, f"{layer} {rows} {name}")
                    timed = lambda w, x=x, c=config: skinny_gemm(x, w, config=c)  # noqa: E731
                    entry[f"{name}_us"] = time_us(timed, weights)
                for name in ("n32k256", "n16k256"):
                    config = split_module.CONFIGS[name]
                    chosen = split_module.choose_splits(out_features, in_features, config, sms)
                    steps = -(-in_features // config.block_k)
                    for splits in sorted({chosen, 2, 4} if name == "n32k256" else {chosen}):
                        if splits > steps:
                            continue
                        split = split_module.skinny_split_gemm
                        result = split(x, weights[0], config=config, splits=splits)
                        check(result, reference, f"{layer} {name} {splits}")
                        entry[f"split_{name}_s{splits}_us"] = time_us(
                            lambda w, x=x, c=config, s=splits: split_module.skinny_split_gemm(
                                x, w, config=c, splits=s
                            ),
                            weights,
                        )
                    entry[f"split_{name}_chosen_splits"] = chosen
                add_fractions(entry, weight_bytes, bandwidth)
                results.append(entry)
            del weights
            torch.cuda.empty_cache()
    return results


def print_side_by_side(results: list[dict], names: list[str]) -> None:
    """One line per weight and row count: cuBLAS and each split config, us and fraction of copy bw."""
    for entry in results:
        cells = [f"cuBLAS {entry['cublas_us']:6.2f} us {entry['cublas_copy_bw_frac']:.2f}"]
        for name in names:
            us, frac = entry[f"split_{name}_us"], entry[f"split_{name}_copy_bw_frac"]
            cells.append(f"{name} {us:6.2f} us {frac:.2f} ({entry[f'split_{name}_splits']} splits)")
        where = f"{entry['model']} {entry['layer']} [{entry['n']}, {entry['k']}] x{entry['rows']}"
        routed = "routed" if entry["routed"] else "not routed"
        print(f"{where} ({routed}): " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="Only the default config, no sweep.")
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-0.6b"])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=list(ROWS), help="rows of x (1 to 32 for the kernels)"
    )
    parser.add_argument("--split", action="store_true", help="The small weights: cuBLAS against split-K.")
    parser.add_argument(
        "--split-configs",
        nargs="+",
        default=list(split_module.CONFIGS),
        choices=list(split_module.CONFIGS),
        help="skinny_split_gemm configs to time with --split",
    )
    parser.add_argument(
        "--split-prefetch-steps",
        type=int,
        default=split_module.PREFETCH_STEPS,
        help="BLOCK_K steps a row skinny_split_gemm asks the L2 for before its PDL wait (0: off)",
    )
    parser.add_argument("--no-pdl", action="store_true", help="Launch without programmatic dependent launch.")
    parser.add_argument("--tp-shapes", action="store_true", help="One rank's linears at --tp-sizes.")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    bandwidth = copy_bandwidth_bytes_per_s()
    dependent_launch.ENABLED = not args.no_pdl
    if args.tp_shapes:
        models = args.models if "--models" in sys.argv else list(TP_MODELS)
        results = tp_entries(models, args.tp_sizes, args.rows, bandwidth)
        figures = {"copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1), "layers": results}
        save("skinny_tp_shapes", figures, args.out)
        return
    if args.split:
        split_module.PREFETCH_STEPS = args.split_prefetch_steps
        models = args.models if "--models" in sys.argv else list(SPLIT_MODELS)
        results = split_entries(models, args.rows, args.split_configs, bandwidth)
        print_side_by_side(results, args.split_configs)
        figures = {"copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1), "layers": results}
        figures["split_prefetch_steps"] = args.split_prefetch_steps
        figures["pdl"] = not args.no_pdl
        save("skinny_split_gemm", figures, args.out)
        return
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
