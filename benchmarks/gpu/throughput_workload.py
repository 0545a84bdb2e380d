"""The nano and equal workloads of issue 4 (Qwen3-0.6B shape, dummy weights), offline, output tok/s.

python benchmarks/gpu/throughput_workload.py nano     # vLLM 0.26.0: 17,603 output tok/s
python benchmarks/gpu/throughput_workload.py equal    # vLLM 0.26.0: 23,302 output tok/s
python benchmarks/gpu/throughput_workload.py equal --kv-cache-dtype fp8   # the same, with an fp8 KV cache
"""

from __future__ import annotations

import argparse
import time

from common import MODELS, TOKENIZER, save  # noqa: I001  (sets the process start time first)

from fitserve import LLM, SamplingParams
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
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [
        SamplingParams(temperature=workload.temperature, max_tokens=r.max_tokens, ignore_eos=True)
        for r in workload.requests
    ]
    # Warm-up, not timed: Triton compiles a kernel variant the first time a shape class meets it. Graph
    # capture at startup covers the decode batches; every prompt once (2 tokens each) covers the prefill
    # chunks and the mixed prefill + decode steps. The compile time is counted in startup8b instead.
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    name = args.workload if args.kv_cache_dtype == "auto" else f"{args.workload}_kv_{args.kv_cache_dtype}"
    if args.max_num_batched_tokens:
        name += f"_batched_{args.max_num_batched_tokens}"
    save(
        name,
        {
            "kv_cache_dtype": args.kv_cache_dtype,
            "max_num_batched_tokens": llm.engine.config.scheduler.max_num_batched_tokens,
            "requests": len(outputs),
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": output_tokens,
            "seconds": round(elapsed, 3),
            "out_tok_per_s": round(output_tokens / elapsed, 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
