"""Batch-1 decode of the Llama-3.1-8B shape (bf16, dummy weights): 128 tokens in, 256 out.

Output tok/s and its fraction of the copy-bandwidth roofline (weight bytes read once per token),
bandwidth measured in the same run. vLLM 0.26.0: 152.5 tok/s, 81% of the roofline.
  python benchmarks/gpu/single8b.py [--no-pdl] [--prefetch-row-bytes N]
"""

from __future__ import annotations

import argparse
import random
import time

from common import MODELS, TOKENIZER, copy_bandwidth_bytes_per_s, save  # noqa: I001

from fitserve import LLM, SamplingParams


def prefetch_row_bytes() -> int:
    from fitserve.kernels import skinny_gemm

    return skinny_gemm.PREFETCH_ROW_BYTES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch kernels without programmatic dependent launch (to compare)",
    )
    parser.add_argument(
        "--prefetch-row-bytes",
        type=int,
        default=None,
        help="bytes of each weight row the skinny GEMM prefetches into L2 before its wait (0: none)",
    )
    args = parser.parse_args()
    if args.prefetch_row_bytes is not None:
        from fitserve.kernels import skinny_gemm

        skinny_gemm.PREFETCH_ROW_BYTES = args.prefetch_row_bytes
    if args.no_pdl:
        from fitserve.kernels import dependent_launch

        dependent_launch.ENABLED = False
    llm = LLM(str(MODELS / "llama-3.1-8b"), tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=4096)
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.executor.runner.model.parameters())
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    times = []
    for i in range(args.iters + 1):
        prompt = {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(128)]}
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i > 0:  # the first run warms up
            times.append(time.perf_counter() - start)
    best = min(times)
    tok_per_s = 256 / best
    bandwidth = copy_bandwidth_bytes_per_s()
    roofline = bandwidth / weight_bytes
    save(
        "single8b_no_pdl" if args.no_pdl else "single8b",
        {
            "tok_per_s": round(tok_per_s, 1),
            "seconds_per_request": [round(t, 4) for t in times],
            "weight_bytes": weight_bytes,
            "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
            "roofline_tok_per_s": round(roofline, 1),
            "roofline_frac": round(tok_per_s / roofline, 3),
            "skinny_gemm_prefetch_row_bytes": prefetch_row_bytes(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
