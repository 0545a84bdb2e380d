"""Micro-benchmark of fitserve's Triton attention kernels on one GPU.

Decode attention is memory bound: its figure of merit is the key/value bytes it reads per second,
set against the device-to-device copy bandwidth measured in the same run (bytes read + written).
do_bench flushes L2 before every timed call, so even the 1.5 MB batch-1 cache comes from HBM.

    python3 benchmarks/kernels_bench.py --output benchmarks/results/kernels_h100.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fitserve.kernels.decode_attention import (  # noqa: E402
    DEFAULT_DECODE_CONFIG,
    DecodeLaunchConfig,
    choose_num_partitions,
    paged_decode_attention,
)
from fitserve.kernels.prefill_attention import (  # noqa: E402
    DEFAULT_PREFILL_CONFIG,
    PrefillLaunchConfig,
    paged_prefill_attention,
)
from fitserve.kernels.reference import paged_attention_reference  # noqa: E402

DEVICE = torch.device("cuda")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096  # block tables are as wide as the engine's would be at this max_model_len
DECODE_SWEEP = [
    DecodeLaunchConfig(32, 4, 2),
    DecodeLaunchConfig(64, 4, 2),
    DecodeLaunchConfig(64, 4, 3),
    DecodeLaunchConfig(128, 4, 3),
]
PREFILL_SWEEP = [
    PrefillLaunchConfig(64, 64, 4, 2),
    PrefillLaunchConfig(64, 64, 4, 3),
    PrefillLaunchConfig(128, 64, 8, 2),
    PrefillLaunchConfig(128, 64, 8, 3),
]


def copy_bandwidth_gbs() -> float:
    num_bytes = 1 << 30
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def paged_inputs(
    seq_lens: list[int], num_tokens: int, q_heads: int, kv_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks, dtype=torch.int32)  # scattered blocks, as in a used block pool
    block_tables = torch.zeros(len(seq_lens), MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = order[taken : taken + count]
        taken += count
    return {
        "q": torch.randn(num_tokens, q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16),
        "kv_cache": torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=DEVICE).bfloat16(),
        "block_tables": block_tables.to(DEVICE),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    }


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def time_with_graph(run: Callable[[], None]) -> tuple[float, float]:
    """(eager ms, CUDA-graph replay ms), both medians with L2 flushed before each call.

    The eager figure includes whatever launch gaps the host's Python leaves on the GPU; the graph
    replay has none, and is how the engine runs decode.
    """
    eager_ms = do_bench(run, warmup=25, rep=200, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph_ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return eager_ms, graph_ms


def kernel_times_us(run: Callable[[], None], calls: int = 20) -> dict[str, float]:
    """Average device time per call of each kernel that run launches (torch profiler, L2 flushed)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            flush.zero_()
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in profiler.key_averages():
        if "kernel" in event.key and "elementwise" not in event.key and "fill" not in event.key:
            times[event.key[:40]] = round(event.device_time_total / calls, 2)
    return times


def bench_decode(
    name: str,
    seq_lens: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    variants: list[tuple[DecodeLaunchConfig, int | None]],
) -> list[dict[str, Any]]:
    """One row per (launch config, num_partitions; None = the launcher's own choice)."""
    batch = len(seq_lens)
    inputs = paged_inputs(seq_lens, batch, q_heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = torch.empty_like(inputs["q"])
    expected = paged_attention_reference(
        inputs["q"],
        inputs["kv_cache"],
        torch.arange(batch + 1),
        inputs["seq_lens"],
        inputs["block_tables"],
        scale,
    )
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * inputs["kv_cache"].element_size()
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    rows = []
    for config, partitions in variants:

        def run(config: DecodeLaunchConfig = config, partitions: int | None = partitions) -> None:
            paged_decode_attention(
                inputs["q"],
                inputs["kv_cache"],
                inputs["block_tables"],
                inputs["seq_lens"],
                scale,
                out,
                partitions,
                config,
            )

        out.fill_(float("nan"))
        run()
        error = relative_error(out, expected)
        eager_ms, graph_ms = time_with_graph(run)
        kernel_us = kernel_times_us(run)
        chosen = choose_num_partitions(batch, kv_heads, MAX_MODEL_LEN, sm_count, config.tile_tokens)
        rows.append(
            {
                "case": name,
                "batch": batch,
                "q_heads": q_heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "block_size": BLOCK_SIZE,
                "total_context_tokens": sum(seq_lens),
                "num_partitions": partitions or chosen,
                "is_default": config == DEFAULT_DECODE_CONFIG and partitions is None,
                "config": vars(config),
                "kv_read_bytes": kv_bytes,
                "us_graph": round(graph_ms * 1e3, 2),
                "us_eager": round(eager_ms * 1e3, 2),
                "kv_read_gbs": round(kv_bytes / (graph_ms * 1e-3) / 1e9, 1),
                "kv_read_gbs_eager": round(kv_bytes / (eager_ms * 1e-3) / 1e9, 1),
                "relative_error_vs_reference": error,
                "kernel_us": kernel_us,
            }
        )
    return rows


def bench_prefill(
    name: str, prompt_lens: list[int], q_heads: int, kv_heads: int, head_dim: int
) -> list[dict]:
    inputs = paged_inputs(prompt_lens, sum(prompt_lens), q_heads, kv_heads, head_dim)
    query_start_loc = torch.tensor([0, *torch.tensor(prompt_lens).cumsum(0).tolist()], dtype=torch.int32)
    query_start_loc = query_start_loc.to(DEVICE)
    scale = head_dim**-0.5
    out = torch.empty_like(inputs["q"])
    causal_pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    flops = 4 * causal_pairs * q_heads * head_dim  # two matmuls, 2 flops per multiply-add
    rows = []
    for config in PREFILL_SWEEP:

        def run(config: PrefillLaunchConfig = config) -> None:
            paged_prefill_attention(
                inputs["q"],
                inputs["kv_cache"],
                query_start_loc,
                inputs["seq_lens"],
                inputs["block_tables"],
                max(prompt_lens),
                scale,
                out,
                config,
            )

        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        rows.append(
            {
                "case": name,
                "prompt_lens": f"{len(prompt_lens)} x {prompt_lens[0]}",
                "q_heads": q_heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "config": vars(config),
                "is_default": config == DEFAULT_PREFILL_CONFIG,
                "us": round(ms * 1e3, 2),
                "tflops": round(flops / (ms * 1e-3) / 1e12, 1),
            }
        )
    return rows


MID_BATCH_SWEEP = [
    DecodeLaunchConfig(64, 4, 2),
    DecodeLaunchConfig(64, 4, 3),
    DecodeLaunchConfig(64, 4, 4),
    DecodeLaunchConfig(64, 8, 3),
    DecodeLaunchConfig(128, 8, 3),
    DecodeLaunchConfig(32, 4, 4),
]


def bench_mid_batches(rng: random.Random) -> list[dict[str, Any]]:
    """Launch configs at the batch sizes where nano's batch shrinks and serving runs (32 to 128 rows)."""
    rows = []
    sweep = [(config, None) for config in MID_BATCH_SWEEP]
    mixed = [rng.randint(200, 2048) for _ in range(128)]
    rows += bench_decode("mid: batch 128, ctx in [200, 2048], Qwen3-0.6B", mixed, 16, 8, 128, sweep)
    rows += bench_decode("mid: batch 64, ctx in [200, 2048], Qwen3-0.6B", mixed[:64], 16, 8, 128, sweep)
    rows += bench_decode("mid: batch 32, ctx 1536, Llama-3.1-8B", [1536] * 32, 32, 8, 128, sweep)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--mid-batches", action="store_true", help="only the launch-config sweep at 32 to 128 sequences"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    copy_gbs = copy_bandwidth_gbs()
    if args.mid_batches:
        report(bench_mid_batches(rng), [], copy_gbs, args.output)
        return
    default = DEFAULT_DECODE_CONFIG
    config_sweep = [(config, None) for config in DECODE_SWEEP]
    decode = bench_decode("single8b_decode: batch 1, ctx 384, Llama-3.1-8B", [384], 32, 8, 128, config_sweep)
    decode += bench_decode(
        "batch 1, ctx 384, Llama-3.1-8B, partitions",
        [384],
        32,
        8,
        128,
        [(default, 1), (default, 12)],
    )
    nano_lens = [rng.randint(900, 1100) for _ in range(256)]
    decode += bench_decode(
        "nano_decode: batch 256, ctx ~1000, Qwen3-0.6B", nano_lens, 16, 8, 128, config_sweep
    )
    decode += bench_decode(
        "batch 1, ctx 4096, Llama-3.1-8B",
        [4096],
        32,
        8,
        128,
        [(default, None), (default, 32), (default, 16)],
    )
    decode += bench_decode(
        "batch 16, ctx 2048, Llama-3.1-8B", [2048] * 16, 32, 8, 128, [(default, None), (default, 1)]
    )
    decode += bench_decode(
        "batch 32, ctx 2048, Qwen3-0.6B", [2048] * 32, 16, 8, 128, [(default, None), (default, 2)]
    )
    partition_counts = [(default, None), (default, 2), (default, 4)]
    mixed = [rng.randint(200, 2048) for _ in range(256)]
    decode += bench_decode(
        "nano mixed: batch 256, ctx in [200, 2048], Qwen3-0.6B", mixed, 16, 8, 128, partition_counts
    )
    decode += bench_decode(
        "nano mixed: batch 64, ctx in [200, 2048], Qwen3-0.6B", mixed[:64], 16, 8, 128, partition_counts
    )
    decode += bench_decode(
        "serve c32: batch 32, ctx 1536, Llama-3.1-8B", [1536] * 32, 32, 8, 128, partition_counts
    )
    prefill = bench_prefill("prefill: 16 x 1024 fresh prompts, Qwen3-0.6B", [1024] * 16, 16, 8, 128)
    report(decode, prefill, copy_gbs, args.output)


def report(decode: list[dict], prefill: list[dict], copy_gbs: float, output: Path | None) -> None:
    for row in decode:
        row["fraction_of_copy_bandwidth"] = round(row["kv_read_gbs"] / copy_gbs, 3)
    result = {
        "gpu": torch.cuda.get_device_name(DEVICE),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "command": "python3 " + " ".join(sys.argv),
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "decode": decode,
        "prefill": prefill,
    }
    text = json.dumps(result, indent=2)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    print(text)
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s")
    for row in decode:
        config = row["config"]
        print(
            f"{row['case'][:44]:44s} tile={config['tile_tokens']:3d} warps={config['num_warps']} "
            f"stages={config['num_stages']} parts={row['num_partitions']:2d} graph {row['us_graph']:7.1f} us "
            f"{row['kv_read_gbs']:6.0f} GB/s ({row['fraction_of_copy_bandwidth']:.0%}) "
            f"eager {row['us_eager']:7.1f} us err={row['relative_error_vs_reference']:.1e} {row['kernel_us']}"
        )
    for row in prefill:
        print(f"{row['case'][:44]:44s} {row['config']} {row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
