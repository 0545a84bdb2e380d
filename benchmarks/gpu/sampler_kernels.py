"""The sampler's kernels alone: greedy argmax and the exponential race (random sampling at a
temperature) over a decode step's logits, microseconds per call from CUDA graph replays.

nano samples 256 rows of Qwen3's 151,936 logits at temperature 0.6 in every full decode step, so the
race's cost is paid ~1,000 times a run.

  python benchmarks/gpu/sampler_kernels.py [--vocab 151936] [--out ...]
"""

from __future__ import annotations

import argparse

import torch
from common import graph_call_ms, save

from fitserve.kernels.argmax import argmax_rows, race_rows

CALLS_PER_GRAPH = 10


def us_per_call(call) -> float:
    return round(graph_call_ms(call, CALLS_PER_GRAPH) * 1e3, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = []
    seed = torch.tensor([5], device="cuda")
    for rows in (1, 32, 128, 256):
        logits = torch.randn(rows, args.vocab, device="cuda").to(torch.bfloat16)
        scale = torch.full((rows,), 1 / 0.6, device="cuda")
        runs.append(
            {
                "rows": rows,
                "argmax_bf16_us": us_per_call(lambda logits=logits: argmax_rows(logits)),
                "race_bf16_us": us_per_call(lambda logits=logits, s=scale: race_rows(logits, seed, s)),
                "race_fp32_us": us_per_call(lambda f=logits.float(), s=scale: race_rows(f, seed, s)),
            }
        )
        print(runs[-1], flush=True)
    save("sampler_kernels", {"vocab": args.vocab, "temperature": 0.6, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
