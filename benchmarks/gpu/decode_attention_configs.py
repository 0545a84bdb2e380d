"""Decode attention with one partition (each program streams a whole context) under launch configs:
the default tile against WHOLE_CONTEXT_CONFIG and a few others, for batches whose programs number
one or two per SM (the 8B shape at concurrency 17 to 32), four per SM (Qwen3-0.6B's batch 64) and a
busy server's 64 to 256 sequences over contexts of a few hundred tokens, with contexts all equal and
evenly spread. --partitions also times each config with every context split into N partitions (the
reduce kernel merging them), as choose_num_partitions does for small batches.

One layer's attention per call, cycling through four KV caches (more than the L2 holds), timed as
CUDA graph replays. Prints and saves microseconds per call and the KV read bandwidth, with each
config's shared memory and registers per program (what decides how many programs an SM holds).
--kv-cache-dtype fp8 (e4m3) or fp8_e5m2 times a float8 cache (a byte an element: a tile of as many keys
holds half the bytes, so the larger tiles at the end of CONFIGS fit).

  python benchmarks/gpu/decode_attention_configs.py [--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2]
      [--partitions 1 2 4] [--cases "batch 128"] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from common import graph_call_ms, save  # noqa: I001

from fitserve.config import FP8_KV_CACHE_DTYPES
from fitserve.kernels import decode_attention
from fitserve.kernels.decode_attention import DecodeLaunchConfig, paged_decode_attention

BLOCK_SIZE = 16
HEAD_DIM = 128
CACHES = 4
CONFIGS = [  # (tile_tokens, num_warps, num_stages)
    (64, 4, 2),  # DEFAULT_DECODE_CONFIG
    (128, 4, 5),  # WHOLE_CONTEXT_CONFIG
    (128, 4, 4),
    (128, 4, 2),
    (64, 4, 4),
    (64, 8, 5),
    (32, 4, 5),
    (128, 4, 8),  # the last three: float8 caches (a 16-bit cache's tiles would not fit)
    (256, 4, 4),
    (256, 8, 4),
]
KV_DTYPES = {"auto": torch.bfloat16, **FP8_KV_CACHE_DTYPES}  # --kv-cache-dtype: auto is the queries' bf16


def spread(batch: int, low: int, high: int) -> list[int]:
    return torch.linspace(low, high, batch).round().long().tolist()


CASES = [  # name, context lengths, query heads, KV heads
    ("8B shape, batch 17, contexts 1024..2048", spread(17, 1024, 2048), 32, 8),
    ("8B shape, batch 24, contexts 1024..2048", spread(24, 1024, 2048), 32, 8),
    ("8B shape, batch 32, contexts 1024..2048", spread(32, 1024, 2048), 32, 8),
    ("8B shape, batch 32, contexts 1536", [1536] * 32, 32, 8),
    ("8B shape, batch 32, contexts 64..4000", spread(32, 64, 4000), 32, 8),
    ("Qwen3-0.6B shape, batch 64, contexts 1024", [1024] * 64, 16, 8),
    ("Qwen3-0.6B shape, batch 256, contexts 512..1024", spread(256, 512, 1024), 16, 8),
    # a busy server (issue 27): many requests over contexts of a few hundred tokens
    ("8B shape, batch 128, contexts 256..768", spread(128, 256, 768), 32, 8),
    ("8B shape, batch 64, contexts 256..768", spread(64, 256, 768), 32, 8),
    ("Qwen3-30B-A3B shape, batch 256, contexts 512..640", spread(256, 512, 640), 32, 4),
    ("Qwen3-30B-A3B shape, batch 128, contexts 256..768", spread(128, 256, 768), 32, 4),
]


def paged_caches(
    lens: list[int], kv_heads: int, kv_dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """CACHES random caches; sequence i owns consecutive blocks; int32 block tables and lengths."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks) + 1
    caches = [
        torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda").to(kv_dtype)
        for _ in range(CACHES)
    ]
    tables = torch.zeros(len(lens), max(blocks) + 1, dtype=torch.int32)
    first = 1
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    return caches, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def program_resources() -> dict[str, dict[str, int]]:
    """Shared memory bytes and registers per program of each compiled one-partition variant."""
    resources = {}
    for key, kernel in decode_attention._decode_partition_kernel._compiled.items():
        options = dict(key[2])
        if not options.get("WRITE_DIRECT"):
            continue
        name = f"{options['TILE_N']}x{options['num_warps']}x{options['num_stages']}"
        resources[name] = {"shared_bytes": kernel.metadata.shared, "registers": kernel.n_regs}
    return resources


def time_configs(
    lens: list[int], q_heads: int, kv_heads: int, kv_dtype: torch.dtype, partitions: list[int]
) -> dict[str, float]:
    """Microseconds per call of each config in CONFIGS (those that fit the GPU) at each partition count
    (a split of every context, merged by the reduce kernel; keyed "/pN" past one), outputs checked alike."""
    caches, tables, seq_lens = paged_caches(lens, kv_heads, kv_dtype)
    q = torch.randn(len(lens), q_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    timings: dict[str, float] = {}
    reference = None
    for (tile, warps, stages), parts in itertools.product(CONFIGS, partitions):
        config = DecodeLaunchConfig(tile_tokens=tile, num_warps=warps, num_stages=stages)
        calls = iter(range(1 << 30))  # every config's last call reads the same cache: outputs compare

        def call(config: DecodeLaunchConfig = config, calls=calls, parts: int = parts) -> None:
            cache = caches[next(calls) % CACHES]
            paged_decode_attention(
                q, cache, tables, seq_lens, 0.088, out, num_partitions=parts, config=config
            )

        try:
            us = graph_call_ms(call, calls=2 * CACHES) * 1e3
        except triton.runtime.errors.OutOfResources:
            continue  # more shared memory than this GPU has
        if reference is None:
            reference = out.clone()
        torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)
        timings[f"{tile}x{warps}x{stages}" + (f"/p{parts}" if parts > 1 else "")] = round(us, 2)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="auto")
    parser.add_argument("--partitions", type=int, nargs="+", default=[1], help="partition counts to time")
    parser.add_argument("--cases", default="", help="only the cases whose name holds this text")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kv_dtype = KV_DTYPES[args.kv_cache_dtype]
    torch.manual_seed(0)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for name, lens, q_heads, kv_heads in CASES:
        if args.cases not in name:
            continue
        timings = time_configs(lens, q_heads, kv_heads, kv_dtype, args.partitions)
        kv_bytes = sum(lens) * kv_heads * HEAD_DIM * 2 * kv_dtype.itemsize
        chosen = decode_attention.choose_config(
            len(lens), kv_heads, 1, sm_count, HEAD_DIM, kv_element_bytes=kv_dtype.itemsize
        )
        entry = {
            "case": name,
            "kv_cache_dtype": str(kv_dtype),
            "kv_mb": round(kv_bytes / 1e6, 1),
            "us_by_tile_warps_stages": timings,
            "shipped": f"{chosen.tile_tokens}x{chosen.num_warps}x{chosen.num_stages}",
            "default_tb_per_s": round(kv_bytes / timings["64x4x2"] / 1e6, 2),
            "best": min(timings, key=timings.get),
            "best_tb_per_s": round(kv_bytes / min(timings.values()) / 1e6, 2),
        }
        print(entry, flush=True)
        cases.append(entry)
        torch.cuda.empty_cache()
    save("decode_attention_configs", {"cases": cases, "program_resources": program_resources()}, args.out)


if __name__ == "__main__":
    main()
