"""Triton paged attention at Gemma-4's head dims, with and without a sliding window.

Decode (one token per sequence, batch 1 and 32): 8k contexts with window 1,024 against no window, and a
100k context with window 1,024 (it should cost about what the 8k one does: only the window's ~1k keys are
read). Prefill: one fresh 4k prompt at head dim 256 (window 1,024 and none) and 512. Shapes: 26B-A4B's
sliding layers (16 query heads, 8 KV heads x 256) and full layers (16 x 2 KV heads x 512, 8 query heads per
KV head); blocks of 16, bf16, scale 1.0. Each case is timed with triton's do_bench (median); decode reports
the K/V bytes it must read per second, prefill the TFLOP/s of its visible (causal, windowed) pairs.
--sweep also times candidate launch configs beside the chosen one (for tuning choose_config and
choose_prefill_config at these head dims).
  python benchmarks/gpu/attention_window_bench.py [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from common import save  # noqa: I001
from triton.testing import do_bench

from fitserve.kernels import decode_attention
from fitserve.kernels.decode_attention import DecodeLaunchConfig, paged_decode_attention
from fitserve.kernels.prefill_attention import (
    PrefillLaunchConfig,
    choose_prefill_config,
    paged_prefill_attention,
)

BLOCK = 16
SLIDING = (16, 8, 256)  # query heads, KV heads, head dim
FULL = (16, 2, 512)
DECODE_CASES = [
    # (name, shape, batch, context, window)
    ("d256 b1 8k", SLIDING, 1, 8192, None),
    ("d256 b1 8k window 1024", SLIDING, 1, 8192, 1024),
    ("d256 b1 100k window 1024", SLIDING, 1, 100_000, 1024),
    ("d256 b32 8k", SLIDING, 32, 8192, None),
    ("d256 b32 8k window 1024", SLIDING, 32, 8192, 1024),
    ("d512 b1 8k", FULL, 1, 8192, None),
    ("d512 b32 8k", FULL, 32, 8192, None),
]
PREFILL_CASES = [
    # (name, shape, prompt tokens, window)
    ("d256 4k", SLIDING, 4096, None),
    ("d256 4k window 1024", SLIDING, 4096, 1024),
    ("d512 4k", FULL, 4096, None),
    ("d512 4k window 1024", FULL, 4096, 1024),
]
DECODE_SWEEP = [
    DecodeLaunchConfig(16, 4, 2),
    DecodeLaunchConfig(16, 8, 3),
    DecodeLaunchConfig(32, 4, 2),
    DecodeLaunchConfig(32, 4, 3),
    DecodeLaunchConfig(32, 8, 3),
    DecodeLaunchConfig(64, 4, 2),
    DecodeLaunchConfig(64, 8, 2),
]
# (block_n is capped at 32 for heads wider than 128 by the launcher)
PREFILL_SWEEP = [
    PrefillLaunchConfig(32, 16, 8, 2),
    PrefillLaunchConfig(32, 32, 8, 2),
    PrefillLaunchConfig(32, 32, 4, 2),
    PrefillLaunchConfig(64, 16, 8, 2),
    PrefillLaunchConfig(64, 32, 4, 2),
    PrefillLaunchConfig(64, 32, 8, 2),
    PrefillLaunchConfig(128, 32, 8, 2),
]


def paged_cache(shape, contexts: list[int], window: int | None):
    """A cache whose tables hold the null block (0) for blocks wholly behind the window, as a sliding KV
    cache group's do; those blocks are not allocated."""
    _, kv_heads, dim = shape
    live = [
        (0 if window is None else max(0, n - window) // BLOCK, -(-n // BLOCK)) for n in contexts
    ]  # fmt: skip
    num_blocks = 1 + sum(end - first for first, end in live)
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_blocks - 1, device="cuda").to(torch.int32) + 1
    tables = torch.zeros(len(contexts), max(end for _, end in live), dtype=torch.int32, device="cuda")
    taken = 0
    for row, (first, end) in enumerate(live):
        tables[row, first:end] = order[taken : taken + end - first]
        taken += end - first
    return cache, tables


def decode_case(shape, batch: int, context: int, window: int | None, sweep: bool) -> dict:
    heads, kv_heads, dim = shape
    cache, tables = paged_cache(shape, [context] * batch, window)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    keys_read = min(context, window) if window is not None else context
    kv_bytes = 2 * batch * keys_read * kv_heads * dim * 2
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = decode_attention.choose_config(batch, kv_heads, 2, sm_count, dim)
    configs = [None] + (DECODE_SWEEP if sweep else [])
    rows = []
    for config in configs:

        def run(config=config) -> None:
            paged_decode_attention(q, cache, tables, lens, 1.0, out, config=config, window=window)

        try:
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as error:  # a sweep config that does not fit: recorded, not fatal
            rows.append({"config": vars(config) if config else "chosen", "error": str(error)[:200]})
            continue
        rows.append(
            {
                "config": vars(config) if config else {"chosen": vars(chosen)},
                "us": round(ms * 1e3, 1),
                "kv_gb_per_s": round(kv_bytes / ms / 1e6, 1),
            }
        )
    return {"keys_read_per_seq": keys_read, "rows": rows}


def visible_pairs(tokens: int, window: int | None) -> int:
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def prefill_case(shape, tokens: int, window: int | None, sweep: bool) -> dict:
    heads, _, dim = shape
    cache, tables = paged_cache(shape, [tokens], None)  # a fresh prompt: every block is live
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flops = 4 * visible_pairs(tokens, window) * heads * dim
    configs = [None] + (PREFILL_SWEEP if sweep else [])
    rows = []
    for config in configs:

        def run(config=config) -> None:
            paged_prefill_attention(q, cache, starts, lens, tables, tokens, 1.0, out, config, window=window)

        try:
            ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        except Exception as error:  # a sweep config that does not fit: recorded, not fatal
            rows.append({"config": vars(config) if config else "chosen", "error": str(error)[:200]})
            continue
        chosen = choose_prefill_config(tokens, 1, dim)
        rows.append(
            {
                "config": vars(config) if config else {"chosen": vars(chosen)},
                "us": round(ms * 1e3, 1),
                "tflops": round(flops / ms / 1e9, 1),
            }
        )
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate configs too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    figures: dict = {"decode": {}, "prefill": {}}
    for name, shape, batch, context, window in DECODE_CASES:
        figures["decode"][name] = decode_case(shape, batch, context, window, args.sweep)
        print(name, figures["decode"][name]["rows"][0], flush=True)
    for name, shape, tokens, window in PREFILL_CASES:
        figures["prefill"][name] = prefill_case(shape, tokens, window, args.sweep)
        print(name, figures["prefill"][name]["rows"][0], flush=True)
    save("attention_window", figures, args.out)


if __name__ == "__main__":
    main()
