"""GPU time of one decode step's forward (the engine's own CUDA graph: the decoder layers and the final
norm; the LM head and sampling run after it) at given batch sizes and context lengths, against the time
to read the layers' weights and the KV once at the copy bandwidth.

The engine is built as `LLM(...)` builds it (dummy weights); the graph runner's static inputs are
filled with `--context` tokens of KV per sequence (distinct blocks per sequence; `--context-spread S`
spaces the rows' contexts evenly over context +- S instead, as requests of different ages have them)
and the graph of each batch size is replayed back to back. Steadier than end-to-end runs for changes
of a few percent: no host, no scheduler, no sampler.

--timeline also profiles a few replays and charges each kernel with the time it added to the step:
its end minus the previous kernel's end (with programmatic dependent launch kernels overlap, so their
own durations add up to more than the step).
  python benchmarks/gpu/decode_graph.py --model llama-3.1-8b --batch 1 32 --context 1536
      [--context-spread 512] [--whole-context-config 64,4,2] [--timeline] [--format int4]
(--format int4: the shape with quant_suite.py's GPTQ group-128 config, its packed weights counted.)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import TOKENIZER, copy_bandwidth_bytes_per_s, replay_ms, save  # noqa: I001
from quant_suite import model_dir, step_bytes

from fitserve import LLM
from fitserve.kernels import decode_attention
from fitserve.kernels.decode_attention import DecodeLaunchConfig


def row_contexts(batch: int, context: int, spread: int) -> torch.Tensor:
    """Each row's KV tokens: `context` for every row, or evenly spaced over context +- spread (as in
    serving, where requests are at different points of their output)."""
    if batch == 1 or spread == 0:
        return torch.full((batch,), context, dtype=torch.int64)
    return torch.linspace(context - spread, context + spread, batch).round().long()


def fill_static_inputs(
    graph_runner, batch: int, contexts: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """Row i decodes position contexts[i] with contexts[i] tokens of KV before it in its own blocks."""
    blocks_per_seq = int(contexts.max()) // block_size + 1
    if blocks_per_seq > graph_runner.block_tables.shape[1] or 1 + batch * blocks_per_seq > num_blocks:
        raise SystemExit(
            f"a context of {int(contexts.max())} at batch {batch} needs {batch * blocks_per_seq} KV "
            f"blocks of {blocks_per_seq} per sequence; the engine has {num_blocks - 1} blocks and at "
            f"most {graph_runner.block_tables.shape[1]} per sequence: use a smaller --context or batch"
        )
    contexts = contexts.to("cuda")
    first_blocks = 1 + torch.arange(batch, device="cuda", dtype=torch.int32)[:, None] * blocks_per_seq
    table = first_blocks + torch.arange(blocks_per_seq, device="cuda", dtype=torch.int32)[None, :]
    graph_runner.block_tables[:batch].zero_()
    graph_runner.block_tables[:batch, :blocks_per_seq] = table
    graph_runner.input_ids[:batch] = torch.randint(0, 10000, (batch,), device="cuda")
    graph_runner.positions[:batch] = contexts
    graph_runner.seq_lens[:batch] = (contexts + 1).to(graph_runner.seq_lens.dtype)
    last_block = table.gather(1, (contexts // block_size)[:, None]).squeeze(1).long()
    graph_runner.slot_mapping[:batch] = last_block * block_size + contexts % block_size


def parse_launch_config(text: str) -> DecodeLaunchConfig:
    """ "TILE,WARPS,STAGES" (e.g. 64,4,2) -> a DecodeLaunchConfig, or exit naming the value."""
    values = text.split(",")
    if len(values) != 3 or not all(value.strip().isdigit() and int(value) > 0 for value in values):
        raise SystemExit(
            f"--whole-context-config {text!r} is not three positive integers TILE,WARPS,STAGES: "
            "write e.g. 64,4,2 (the default tile) or 128,4,5"
        )
    tile, warps, stages = (int(value) for value in values)
    if tile < 16 or tile & (tile - 1):
        raise SystemExit(
            f"--whole-context-config: TILE {tile} must be a power of two >= 16: write e.g. 64 or 128"
        )
    return DecodeLaunchConfig(tile_tokens=tile, num_warps=warps, num_stages=stages)


def timeline_us(graph, replays: int = 5) -> dict[str, float]:
    """Microseconds per replay that each kernel name added to the step's span (sorted, largest first)."""
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in profiler.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    added: dict[str, float] = {}
    previous_end = kernels[0][0]
    for _start, end, name in kernels:
        # a kernel that starts after the previous one ended also owns the gap before it (the first
        # kernel of a replay: the gap between replays)
        added[name[:60]] = added.get(name[:60], 0.0) + max(0.0, end - previous_end)
        previous_end = max(previous_end, end)
    return {name: round(us / replays, 1) for name, us in sorted(added.items(), key=lambda item: -item[1])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b", help="a shape in shared/models")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="captured batch sizes")
    parser.add_argument("--context", type=int, default=1536, help="KV tokens before each decoded token")
    parser.add_argument(
        "--context-spread",
        type=int,
        default=0,
        help="rows' contexts evenly spaced over context +- this (0: all equal)",
    )
    parser.add_argument(
        "--whole-context-config",
        default=None,
        metavar="TILE,WARPS,STAGES",
        help="one-partition decode attention's launch config instead of WHOLE_CONTEXT_CONFIG "
        "(64,4,2 is the default tile's)",
    )
    parser.add_argument(
        "--format",
        choices=["bf16", "int4"],
        default="bf16",
        help="int4: the shape with quant_suite.py's GPTQ group-128 config (dummy int4 weights)",
    )
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--timeline", action="store_true", help="also the time each kernel adds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not 0 <= args.context_spread < args.context:
        raise SystemExit(
            f"--context-spread {args.context_spread} must be at least 0 and below --context {args.context} "
            "(every row needs a positive context): use a smaller spread"
        )
    if args.whole_context_config:
        decode_attention.WHOLE_CONTEXT_CONFIG = parse_launch_config(args.whole_context_config)
    with tempfile.TemporaryDirectory() as scratch:
        path = model_dir(args.model, args.format, Path(scratch))
        llm = LLM(path, tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=4096)
    runner = llm.engine.executor.runner
    graph_runner = runner.graph_runner
    if graph_runner is None:
        raise SystemExit("no CUDA graphs were captured (--enforce-eager, or not on CUDA)")
    # the graph reads every weight but the embedding table (a row per token) and the LM head (after it):
    # quant_suite's count of parameters and buffers (quantized formats keep packed words and scales in
    # buffers), less the head
    head = runner.model.lm_head.weight
    weight_bytes = step_bytes(runner.model) - head.numel() * head.element_size()
    kv_bytes_per_token = runner.kv_bytes_per_block() // runner.block_size
    bandwidth = copy_bandwidth_bytes_per_s()
    steps = []
    for batch in args.batch:
        if batch not in graph_runner.graphs:
            raise SystemExit(f"batch {batch} has no graph; captured sizes: {sorted(graph_runner.graphs)}")
        contexts = row_contexts(batch, args.context, args.context_spread)
        fill_static_inputs(graph_runner, batch, contexts, runner.block_size, runner.kv_caches[0].shape[1])
        ms = replay_ms(graph_runner.graphs[batch], args.repeats)
        read_bytes = weight_bytes + int(contexts.sum()) * kv_bytes_per_token
        steps.append(
            {
                "batch": batch,
                "context": args.context,
                "context_spread": args.context_spread if batch > 1 else 0,
                "step_ms": round(ms, 4),
                "weights_and_kv_gb": round(read_bytes / 1e9, 3),
                "copy_roofline_ms": round(read_bytes / bandwidth * 1e3, 4),
                "copy_roofline_frac": round(read_bytes / bandwidth * 1e3 / ms, 4),
            }
        )
        if args.timeline:
            steps[-1]["added_us_per_kernel"] = timeline_us(graph_runner.graphs[batch])
        print(steps[-1], flush=True)
    whole_context = decode_attention.WHOLE_CONTEXT_CONFIG
    figures = {
        "model": args.model,
        "format": args.format,
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "whole_context_config": [
            whole_context.tile_tokens,
            whole_context.num_warps,
            whole_context.num_stages,
        ],
        "steps": steps,
    }
    save(f"decode_graph_{args.model}", figures, args.out)


if __name__ == "__main__":
    main()
