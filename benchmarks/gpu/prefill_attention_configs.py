"""The prefill attention kernel's launch configs on long prompts, chunks of long prompts and mixed steps.

Llama-3.1-8B heads (32 query heads, 8 KV heads, head_dim 128, blocks of 16, bf16), each case timed with
triton's do_bench (median) for every config below; TFLOP/s counts the causal pairs' two matmuls.
--kv-cache-dtype fp8 (e4m3) or fp8_e5m2 times a float8 cache (the Triton kernel decodes its bytes).
  python benchmarks/gpu/prefill_attention_configs.py [--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2]
      [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from common import save  # noqa: I001
from triton.testing import do_bench

from fitserve.config import FP8_KV_CACHE_DTYPES
from fitserve.kernels.prefill_attention import PrefillLaunchConfig, paged_prefill_attention

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = {
    "1 x 8192 fresh": ([8192], [8192]),
    "8192 chunk at 24k-32k": ([8192], [32768]),
    "4 x 2048 fresh": ([2048] * 4, [2048] * 4),
    "1024 chunk at 3k-4k beside 32 decodes at 1536": ([1] * 32 + [1024], [1536] * 32 + [4096]),
    "768 prompt beside 128 decodes at 700": ([1] * 128 + [768], [700] * 128 + [768]),
    "64 prompts of 128": ([128] * 64, [128] * 64),
}
CONFIGS = [
    PrefillLaunchConfig(64, 64, 4, 2),
    PrefillLaunchConfig(128, 64, 8, 2),
    PrefillLaunchConfig(128, 64, 8, 3),
    PrefillLaunchConfig(128, 128, 8, 2),
    PrefillLaunchConfig(128, 128, 8, 3),
    PrefillLaunchConfig(64, 128, 4, 2),
    PrefillLaunchConfig(128, 32, 4, 3),
    PrefillLaunchConfig(128, 32, 8, 3),
    PrefillLaunchConfig(64, 32, 4, 3),
]
KV_DTYPES = {"auto": torch.bfloat16, **FP8_KV_CACHE_DTYPES}  # --kv-cache-dtype: auto is the queries' bf16


def causal_pairs(query_lens: list[int], seq_lens: list[int]) -> int:
    return sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens, strict=True))


def paged_inputs(
    query_lens: list[int], seq_lens: list[int], poison: bool = False, kv_dtype: torch.dtype = torch.bfloat16
) -> tuple:
    """(q, cache, query starts, sequence lengths, block tables): each sequence's blocks drawn from a shuffled
    pool of the 8B shape's heads, the cache in `kv_dtype`; with poison, every slot no sequence owns (block 0,
    spare blocks, the tails of last blocks) holds NaN, so a kernel that reads a key it must not see returns
    NaN."""
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_blocks - 1, device="cuda").to(torch.int32) + 1
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32, device="cuda")
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = order[start : start + count]
        start += count
    if poison:
        owned = torch.zeros(num_blocks, BLOCK, dtype=torch.bool, device="cuda")
        for row, length in enumerate(seq_lens):
            positions = torch.arange(length, device="cuda")
            owned[tables[row, positions // BLOCK].long(), positions % BLOCK] = True
        cache[:, ~owned] = float("nan")
    q = torch.randn(sum(query_lens), Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, cache.to(kv_dtype), starts, lens, tables


def run_case(query_lens: list[int], seq_lens: list[int], kv_dtype: torch.dtype) -> list[dict]:
    q, cache, starts, lens, tables = paged_inputs(query_lens, seq_lens, kv_dtype=kv_dtype)
    out = torch.empty_like(q)
    flops = 4 * causal_pairs(query_lens, seq_lens) * Q_HEADS * HEAD_DIM
    reference = None
    rows = []
    for config in CONFIGS:

        def run(config: PrefillLaunchConfig = config) -> None:
            paged_prefill_attention(
                q, cache, starts, lens, tables, max(query_lens), HEAD_DIM**-0.5, out, config
            )

        run()
        if reference is None:
            reference = out.clone()
        difference = (out.float() - reference.float()).abs().max().item()
        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        rows.append(
            {
                "config": vars(config),
                "us": round(ms * 1e3, 1),
                "tflops": round(flops / ms / 1e9, 1),
                "max_abs_difference_from_first_config": difference,
            }  # fmt: skip
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_DTYPES), default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    figures = {"kv_cache_dtype": args.kv_cache_dtype}
    for name, (query_lens, seq_lens) in CASES.items():
        figures[name] = run_case(query_lens, seq_lens, KV_DTYPES[args.kv_cache_dtype])
        best = max(figures[name], key=lambda row: row["tflops"])
        print(name, "best", best["config"], best["tflops"], "TFLOP/s", flush=True)
    save("prefill_attention_configs", figures, args.out)


if __name__ == "__main__":
    main()
