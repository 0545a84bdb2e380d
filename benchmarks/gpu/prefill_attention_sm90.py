"""The Hopper Gluon prefill attention kernel beside the Triton one, on long prompts, chunks and mixed steps.

Llama-3.1-8B heads (32 query heads, 8 KV heads, head_dim 128, blocks of 16 in a shuffled pool, bf16), the
cases of prefill_attention_configs.py plus the 32k prompt's last 4k chunk. For each case: the Triton kernel
at the config it picks for the step, then kernels/prefill_attention_sm90.py at each config below, each output
compared with the Triton kernel's, and once more over a cache whose unused slots hold NaN (a key the
kernel must not read would show up in the output). TFLOP/s counts the causal pairs' two matmuls.
  python benchmarks/gpu/prefill_attention_sm90.py [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from common import save  # noqa: I001
from prefill_attention_configs import CASES as CONFIG_CASES  # noqa: I001
from prefill_attention_configs import HEAD_DIM, Q_HEADS, causal_pairs, paged_inputs
from triton.testing import do_bench

from fitserve.kernels.prefill_attention import choose_prefill_config, paged_prefill_attention
from fitserve.kernels.prefill_attention_sm90 import Sm90PrefillConfig, paged_prefill_attention_sm90

CASES = {**CONFIG_CASES, "4096 chunk at 28k-32k": ([4096], [32768])}
CONFIGS = [
    Sm90PrefillConfig(128, 32, 3, 8),
    Sm90PrefillConfig(64, 32, 3, 4),
    Sm90PrefillConfig(128, 64, 3, 8),
    Sm90PrefillConfig(64, 64, 3, 4),
    Sm90PrefillConfig(128, 128, 3, 8),
]


def run_case(query_lens: list[int], seq_lens: list[int]) -> dict:
    q, cache, starts, lens, tables = paged_inputs(query_lens, seq_lens)
    flops = 4 * causal_pairs(query_lens, seq_lens) * Q_HEADS * HEAD_DIM
    scale = HEAD_DIM**-0.5
    triton_config = choose_prefill_config(sum(query_lens), len(query_lens))
    reference = paged_prefill_attention(
        q, cache, starts, lens, tables, max(query_lens), scale, None, triton_config
    )
    out = torch.empty_like(q)

    def triton_kernel() -> None:
        paged_prefill_attention(q, cache, starts, lens, tables, max(query_lens), scale, out, triton_config)

    ms = do_bench(triton_kernel, warmup=25, rep=200, return_mode="median")
    rows = {"triton": {"us": round(ms * 1e3, 1), "tflops": round(flops / ms / 1e9, 1)}}
    poisoned = paged_inputs(query_lens, seq_lens, poison=True)
    poisoned_reference = paged_prefill_attention(*poisoned, max(query_lens), scale, None, triton_config)
    for config in CONFIGS:
        name = f"gluon {config.block_m}x{config.block_n} stages {config.num_stages} warps {config.num_warps}"

        def gluon_kernel(config: Sm90PrefillConfig = config) -> None:
            paged_prefill_attention_sm90(q, cache, starts, lens, tables, max(query_lens), scale, out, config)

        try:
            gluon_kernel()
            difference = (out.float() - reference.float()).abs().max().item()
            ms = do_bench(gluon_kernel, warmup=25, rep=200, return_mode="median")
            poisoned_out = paged_prefill_attention_sm90(
                *poisoned, max(query_lens), scale, torch.empty_like(q), config
            )
            poisoned_difference = (poisoned_out.float() - poisoned_reference.float()).abs().max().item()
        except Exception as error:  # a config that does not compile or fit: recorded, the others still run
            rows[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        rows[name] = {
            "us": round(ms * 1e3, 1),
            "tflops": round(flops / ms / 1e9, 1),
            "max_abs_difference_from_triton": difference,
            "max_abs_difference_from_triton_nan_poisoned_cache": poisoned_difference,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    figures = {}
    for name, (query_lens, seq_lens) in CASES.items():
        figures[name] = run_case(query_lens, seq_lens)
        print(name, flush=True)
        for key, row in figures[name].items():
            print("  ", key, row, flush=True)
    save("prefill_attention_sm90", figures, args.out)


if __name__ == "__main__":
    main()
