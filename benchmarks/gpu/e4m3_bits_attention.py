"""What converting a float8 e4m3 KV cache from its bytes costs the attention kernels (issues 35, 32).

Below compute capability 8.9 the kernels get an e4m3 cache as uint8 and decode each key and value with
integer operations and one fp16 multiply (fitserve/kernels/fp8_bits.py) instead of Triton's conversion.
This times, on whatever GPU runs it, decode and prefill attention over the same e4m3 bytes both ways: the
capability forced to 8.9 with Triton's conversion (fp8_bits.BF16_FROM_BYTES off: since the bytes decode
into bfloat16 beat it, 8.9+ takes the bytes beside bfloat16 queries too) and to 8.6 (the bytes), neither
with PDL, with the same launch config, beside a 16-bit cache and e5m2 under the 8.9 choice. fp16 queries
(what auto-fit picks on a T4 or 2080 Ti) and bf16 (A100, A10, RTX 30xx). The figure that says most is the
bytes path against the conversion path: the extra ALU work per element, or the conversion unit's limit.
Also checks that both paths give the same output (the decoded values are exact either way).

Each call is one layer's attention, cycling through four caches (more than the L2 holds), timed as CUDA
graph replays.

  python benchmarks/gpu/e4m3_bits_attention.py [--out FILE]
(default: benchmarks/results/h100_e4m3_bits_attention.json)
"""

from __future__ import annotations

import argparse

import torch
from common import graph_call_ms, save  # noqa: I001

from fitserve.kernels import fp8_bits
from fitserve.kernels.capability import forced_target
from fitserve.kernels.decode_attention import (
    DEFAULT_DECODE_CONFIG,
    choose_num_partitions,
    paged_decode_attention,
)
from fitserve.kernels.prefill_attention import DEFAULT_PREFILL_CONFIG, paged_prefill_attention

BLOCK_SIZE, HEAD_DIM, Q_HEADS, KV_HEADS, CACHES = 16, 128, 32, 8, 4  # the 8B shape
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# name, context lengths, query tokens per sequence (1: decode)
CASES = [
    ("decode, batch 32, contexts 2048", [2048] * 32, 1),
    ("decode, batch 1, context 8192 (split-K)", [8192], 1),
    ("decode, batch 8, contexts 4096", [4096] * 8, 1),
    ("prefill, one prompt of 4096", [4096], 4096),
]
# label, cache dtype (None: the query dtype), forced capability, fp8_bits.BF16_FROM_BYTES
PATHS = [
    ("16-bit cache", None, (8, 9), True),
    ("e5m2", E5M2, (8, 9), True),
    ("e4m3, Triton conversion (8.9)", E4M3, (8, 9), False),
    ("e4m3, from its bytes (8.6)", E4M3, (8, 6), True),
]


def layout(lens: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Blocks in all; int32 block tables (sequence i owns consecutive blocks from 1) and lengths."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 1
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.arange(first, first + count, dtype=torch.int32)
        first += count
    return first, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def time_case(lens: list[int], query_len: int, dtype: torch.dtype) -> dict:
    num_blocks, tables, seq_lens = layout(lens)
    values = [
        torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        for _ in range(CACHES)
    ]
    q = torch.randn(len(lens) * query_len, Q_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda") * query_len
    out = torch.empty_like(q)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    partitions = choose_num_partitions(len(lens), KV_HEADS, tables.shape[1] * BLOCK_SIZE, sm_count, 64)
    kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2
    figures: dict = {}
    outputs = {}
    for label, cache_dtype, capability, from_bytes in PATHS:
        caches = [v.to(cache_dtype) if cache_dtype is not None else v for v in values]
        calls = iter(range(1 << 30))

        def call(caches=caches, calls=calls) -> None:
            cache = caches[next(calls) % CACHES]
            if query_len == 1:
                paged_decode_attention(
                    q, cache, tables, seq_lens, 0.088, out, partitions, DEFAULT_DECODE_CONFIG
                )
            else:
                paged_prefill_attention(
                    q, cache, starts, seq_lens, tables, query_len, 0.088, out, DEFAULT_PREFILL_CONFIG
                )

        fp8_bits.BF16_FROM_BYTES = from_bytes
        with forced_target(capability):
            us = graph_call_ms(call, calls=2 * CACHES) * 1e3
        fp8_bits.BF16_FROM_BYTES = True
        element_bytes = caches[0].element_size()
        figures[label] = {"us": round(us, 2), "kv_gb_per_s": round(kv_bytes * element_bytes / us / 1e3, 1)}
        outputs[label] = out.clone()  # every path's last call read the same cache
    bits, converted = outputs["e4m3, from its bytes (8.6)"], outputs["e4m3, Triton conversion (8.9)"]
    figures["e4m3_paths_equal"] = bool(torch.equal(bits, converted))
    figures["e4m3_paths_max_abs_diff"] = (bits.float() - converted.float()).abs().max().item()
    figures["bytes_over_conversion"] = round(
        figures["e4m3, from its bytes (8.6)"]["us"] / figures["e4m3, Triton conversion (8.9)"]["us"], 3
    )
    figures["num_partitions"] = partitions if query_len == 1 else None
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = []
    for name, lens, query_len in CASES:
        for dtype in (torch.float16, torch.bfloat16):
            entry = {
                "case": name,
                "dtype": str(dtype).removeprefix("torch."),
                **time_case(lens, query_len, dtype),
            }
            print(entry, flush=True)
            cases.append(entry)
            torch.cuda.empty_cache()
    save("e4m3_bits_attention", {"cases": cases}, args.out)


if __name__ == "__main__":
    main()
