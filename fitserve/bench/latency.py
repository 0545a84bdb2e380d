"""`fitserve bench latency`: how long one batch takes from prompt to its last token, offline.

Each iteration generates --batch-size fresh random prompts (so no prefix-cache hits) of --input-len
tokens for --output-len tokens with eos ignored (temperature 1, as `vllm bench latency`), timed around one
`LLM.generate`. --num-iters-warmup iterations run first and are not counted. Reports the average and the
10/25/50/75/90/99th percentile latencies (linear interpolation, as numpy).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from tqdm.auto import tqdm

from fitserve.args import EngineArgs, add_engine_args
from fitserve.bench.metrics import mean, percentile
from fitserve.bench.throughput import machine_info, save_json
from fitserve.bench.workloads import MAX_TOKEN_ID

REPORTED_PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("latency")
    group.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    group.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    group.add_argument("--batch-size", type=int, default=1, help="Requests generated together per iteration.")
    group.add_argument("--num-iters-warmup", type=int, default=10, help="Iterations run before measuring.")
    group.add_argument("--num-iters", type=int, default=30, help="Iterations measured.")
    group.add_argument("--output-json", default=None, help="Save the results to this JSON file.")
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def check_latency_args(args: argparse.Namespace) -> None:
    minimums = {"input_len": 1, "output_len": 1, "batch_size": 1, "num_iters": 1, "num_iters_warmup": 0}
    for name, minimum in minimums.items():
        value = getattr(args, name)
        if value < minimum:
            raise ValueError(
                f"{name}={value} is below the minimum {minimum}: "
                f"set --{name.replace('_', '-')} to {minimum} or more"
            )


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    check_latency_args(args)
    from fitserve.core.sampling_params import SamplingParams
    from fitserve.engine.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_cli(args))
    model = llm.engine.config.model
    if args.input_len + args.output_len > model.max_model_len:
        raise ValueError(
            f"input_len + output_len = {args.input_len + args.output_len} is above max_model_len "
            f"{model.max_model_len}: lower --input-len / --output-len or raise --max-model-len"
        )
    max_token_id = min(MAX_TOKEN_ID, model.vocab_size - 1)
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)

    def one_batch() -> float:
        prompts = [
            {"prompt_token_ids": [rng.randint(0, max_token_id) for _ in range(args.input_len)]}
            for _ in range(args.batch_size)
        ]
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        one_batch()
    latencies = [
        one_batch()
        for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm)
    ]
    average = mean(latencies)
    result = {
        "command": getattr(args, "command_line", None),
        "model": model.model_source,
        "load_format": model.load_format,
        "machine": machine_info(str(llm.engine.config.device.device)),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "num_iters": args.num_iters,
        "avg_latency": average,
        "latencies": latencies,
        "percentiles": {str(p): percentile(latencies, p) for p in REPORTED_PERCENTILES},
        "output_tokens_per_second": args.batch_size * args.output_len / average,
    }
    print(f"Avg latency: {average} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    print(
        f"Output tokens per second: {result['output_tokens_per_second']:.2f} "
        f"({args.batch_size} x {args.output_len} tokens / avg latency)"
    )
    if args.output_json:
        save_json(result, args.output_json)
    return result
