"""The nano and equal workloads of issue 4 (Qwen3-0.6B shape, dummy weights), offline, output tok/s.

python benchmarks/gpu/throughput_workload.py nano     # vLLM 0.26.0: 17,603 output tok/s
python benchmarks/gpu/throughput_workload.py equal    # vLLM 0.26.0: 23,302 output tok/s
python benchmarks/gpu/throughput_workload.py equal --kv-cache-dtype fp8   # the same, with an fp8 KV cache
"""

from __future__ import annotations

import argparse

from common import MODELS, TOKENIZER, save, timed_offline_run  # noqa: I001  (sets the process start time first)

from fitserve import LLM
from fitserve.bench.workloads import named_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=["nano", "equal"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step's token budget (default: the engine's)",
    )
    args = parser.parse_args()
    workload = named_workload(args.workload)
    llm = LLM(
        str(MODELS / "qwen3-0.6b"),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=workload.max_model_len or 4096,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    output_tokens, elapsed = timed_offline_run(llm, workload)
    name = args.workload if args.kv_cache_dtype == "auto" else f"{args.workload}_kv_{args.kv_cache_dtype}"
    if args.max_num_batched_tokens:
        name += f"_batched_{args.max_num_batched_tokens}"
    save(
        name,
        {
            "kv_cache_dtype": args.kv_cache_dtype,
            "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
            "requests": len(workload.requests),
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": output_tokens,
            "seconds": round(elapsed, 3),
            "out_tok_per_s": round(output_tokens / elapsed, 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
