"""`fitserve bench throughput`: offline generation throughput of an engine in this process.

The workload (workloads.py) is built before the engine and timed around one `LLM.generate` call over all
of it, after a short warm-up; eos is ignored so every request generates its full length. Printed and
saved like `vllm bench throughput` (requests/s, total tokens/s, output tokens/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

from fitserve.args import EngineArgs, add_engine_args
from fitserve.bench.workloads import WORKLOAD_NAMES, fixed_length_workload, named_workload

DEFAULT_NUM_PROMPTS = 1000
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4
WARMUP_PROMPTS = 2


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("throughput")
    group.add_argument(
        "--workload",
        default=None,
        choices=list(WORKLOAD_NAMES),
        help="A built-in workload (see docs/benchmarking.md); else give --input-len and --output-len.",
    )
    group.add_argument("--input-len", type=int, default=None, help="Prompt tokens per request (random ids).")
    group.add_argument("--output-len", type=int, default=None, help="Output tokens per request.")
    group.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"Requests, with --input-len (default {DEFAULT_NUM_PROMPTS}).",
    )
    group.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run a tiny generate before timing (compiles kernels on first use).",
    )
    group.add_argument("--output-json", default=None, help="Save the results to this JSON file.")
    group.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def check_throughput_args(args: argparse.Namespace) -> None:
    lengths_given = [
        flag for flag in ("input_len", "output_len", "num_prompts") if getattr(args, flag) is not None
    ]
    if args.workload is not None and lengths_given:
        flags = ", ".join(f"--{flag.replace('_', '-')}" for flag in lengths_given)
        raise ValueError(f"--workload {args.workload} fixes its own lengths: drop {flags}")
    if args.workload is None and (args.input_len is None or args.output_len is None):
        raise ValueError(
            "no workload given: add --workload nano (or equal), "
            "or --input-len N --output-len M [--num-prompts K]"
        )
    for flag in lengths_given:
        value = getattr(args, flag)
        if value < 1:
            dashed = flag.replace("_", "-")
            raise ValueError(f"{flag}={value} is below the minimum 1: set --{dashed} to 1 or more")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    check_throughput_args(args)
    from fitserve.core.sampling_params import SamplingParams
    from fitserve.engine.llm import LLM

    engine_args = EngineArgs.from_cli(args)
    workload = named_workload(args.workload) if args.workload else None
    if workload is not None and workload.max_model_len is not None and engine_args.max_model_len is None:
        engine_args = dataclasses.replace(
            engine_args,
            max_model_len=workload.max_model_len,
            explicit_fields=engine_args.explicit() | {"max_model_len"},
        )
        print(f"Workload {workload.name}: max_model_len {workload.max_model_len}")
    llm = LLM.from_engine_args(engine_args)
    vocab_size = llm.engine.config.model.vocab_size
    if workload is None:
        num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS
        workload = fixed_length_workload(num_prompts, args.input_len, args.output_len, args.seed, vocab_size)
    if workload.max_token_id >= vocab_size:
        raise ValueError(
            f"workload {workload.name} uses token ids up to {workload.max_token_id} but the model's "
            "vocabulary "
            f"has {vocab_size}: use a model with a larger vocabulary"
        )
    prompts = [{"prompt_token_ids": request.prompt_token_ids} for request in workload.requests]
    params = [
        SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=request.max_tokens)
        for request in workload.requests
    ]
    if args.warmup:
        _warm_up(llm, vocab_size)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - started
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    output_tokens = sum(len(completion.token_ids) for output in outputs for completion in output.outputs)
    result = {
        "command": getattr(args, "command_line", None),
        "workload": workload.name,
        "model": llm.engine.config.model.model_source,
        "load_format": llm.engine.config.model.load_format,
        "max_model_len": llm.engine.config.model.max_model_len,
        "machine": machine_info(str(llm.engine.config.device.device)),
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        save_json(result, args.output_json)
    return result


def _warm_up(llm: Any, vocab_size: int) -> None:
    from fitserve.core.sampling_params import SamplingParams

    prompts = [
        {"prompt_token_ids": [(index * 7 + offset) % vocab_size for offset in range(WARMUP_PROMPT_LEN)]}
        for index in range(WARMUP_PROMPTS)
    ]
    llm.generate(prompts, SamplingParams(ignore_eos=True, max_tokens=WARMUP_OUTPUT_LEN), use_tqdm=False)


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": device, "python": platform.python_version(), "torch": torch.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            import triton

            info["triton"] = triton.__version__
        except ModuleNotFoundError:
            info["triton"] = None
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def save_json(result: dict[str, Any], path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"Results saved to {target}")
