"""Issue 28's speed figures for quantized weights (dummy weights in each format, one GPU).

Each figure runs in its own process (`one`), so that one format's memory is gone before the next loads;
`all` runs them in turn and writes one results file.

  python benchmarks/gpu/quant_suite.py all [--formats bf16,int4,fp8,bnb4] [--out FILE]
  python benchmarks/gpu/quant_suite.py one --format int4 --figure single [--model llama-3.1-8b]
      [--kernel-setting int4_gemm.MMA_PROGRAMS_PER_SM=5]   (a kernels module constant set first: trials)

Figures:
- single: batch-1 decode of the Llama-3.1-8B shape, 128 tokens in, 256 out (best of 3 after a warm-up),
  and its fraction of the weight-streaming roofline: the bytes one decode step reads (every tensor the
  model keeps on the GPU, its packed weights, scales and the bf16 LM head, except the input embedding
  table, of which a step reads one row) over the device-to-device copy bandwidth measured in the run.
- b64: one decode step at batch 64 (ms): 64 prompts of 16 tokens, (time to 257 tokens - time to 1) / 256.
- equal: the equal workload's output tok/s on the Qwen3-0.6B shape (as benchmarks/gpu/throughput_workload.py
  runs it), keys `<format>_equal_out_tok_per_s`.

Formats: bf16 (the checkpoint as it is), int4 (a GPTQ group-128 symmetric quantization_config added to the
config, dummy int4 weights through the same kernels a real checkpoint runs), fp8 (`--quantization fp8`),
bnb4 (`--quantization bitsandbytes`: nf4, block 64).

`--engine vllm` runs the same figures on vLLM (0.26.0 from ../shared/vllm_bundle, PYTHONPATH with its site
folder) with the same folder and flags: its GPTQ kernel for int4 (Marlin on these GPUs), its own fp8 and
bitsandbytes paths; single gives tok/s only (the roofline bytes are fitserve's model's). A speed claim is
the ratio of both engines' figures from one lease:

  python benchmarks/gpu/quant_suite.py all --engine vllm --formats bf16,int4,fp8 --out FILE
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # noqa: I001
    MODELS,
    TOKENIZER,
    batch1_decode_seconds,
    copy_bandwidth_bytes_per_s,
    engine_classes,
    engine_single_request,
    machine,
    save,
    timed_offline_run,
)

GPTQ_128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
FLAGS = {"bf16": None, "int4": None, "fp8": "fp8", "bnb4": "bitsandbytes"}


def model_dir(name: str, fmt: str, scratch: Path) -> str:
    """The model folder for `fmt`: the shared config itself, or a copy with an int4 quantization_config."""
    source = MODELS / name
    if fmt != "int4":
        return str(source)
    target = scratch / f"{Path(name).name}-gptq-int4"  # a shape's name or a folder's path
    shutil.copytree(source, target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = GPTQ_128
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)


def step_bytes(model) -> int:
    """Bytes a decode step streams: every parameter and buffer on the GPU but the input embedding table."""
    seen: set[int] = set()
    total = 0
    embed = model.model.embed_tokens.weight.data_ptr() if hasattr(model, "model") else -1
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight.data_ptr() == embed
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "cuda" or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        if tensor.data_ptr() == embed and not tied:
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def run_one(fmt: str, figure: str, model: str, engine: str = "fitserve") -> dict:
    LLM, SamplingParams = engine_classes(engine)
    if figure == "equal":
        return run_equal(fmt, engine)
    with tempfile.TemporaryDirectory() as scratch:
        path = model_dir(model, fmt, Path(scratch))
        llm = LLM(
            path,
            tokenizer=str(TOKENIZER),
            load_format="dummy",
            max_model_len=4096,
            quantization=FLAGS[fmt],
        )
    rng = random.Random(0)
    if figure == "single" and engine == "vllm":
        tok_per_s, times = engine_single_request(llm, SamplingParams, rng)  # the same requests
        return {"tok_per_s": round(tok_per_s, 1), "seconds_per_request": [round(t, 4) for t in times]}
    if figure == "single":
        runner = llm.engine.executor.runner
        times = batch1_decode_seconds(llm, rng)
        tok_per_s = 256 / min(times)
        nbytes = step_bytes(runner.model)
        bandwidth = copy_bandwidth_bytes_per_s()
        return {
            "tok_per_s": round(tok_per_s, 1),
            "seconds_per_request": [round(t, 4) for t in times],
            "step_bytes": nbytes,
            "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
            "roofline_tok_per_s": round(bandwidth / nbytes, 1),
            "roofline_frac": round(tok_per_s * nbytes / bandwidth, 3),
        }
    if figure[0] == "b" and figure[1:].isdigit():  # b64, b4, ...: decode steps at that batch
        batch = int(figure[1:])
        prompts = [{"prompt_token_ids": [rng.randint(0, 10000) for _ in range(16)]} for _ in range(batch)]

        def timed(tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        timed(257)  # warm-up
        short = min(timed(1) for _ in range(3))
        long = min(timed(257) for _ in range(2))
        return {"decode_ms": round((long - short) / 256 * 1e3, 3), "batch": batch}
    raise ValueError(f"figure {figure!r}: use single, b<batch> (b64, b4, ...) or equal")


def run_equal(fmt: str, engine: str = "fitserve") -> dict:
    """The equal workload (issue 4: 256 requests of 512 prompt tokens and 512 output tokens, Qwen3-0.6B
    shape), offline, output tok/s after an untimed pass that compiles every shape class (as
    throughput_workload.py does)."""
    from fitserve.bench.workloads import named_workload

    LLM, SamplingParams = engine_classes(engine)
    workload = named_workload("equal")
    with tempfile.TemporaryDirectory() as scratch:
        llm = LLM(
            model_dir("qwen3-0.6b", fmt, Path(scratch)),
            tokenizer=str(TOKENIZER),
            load_format="dummy",
            max_model_len=workload.max_model_len or 4096,
            quantization=FLAGS[fmt],
        )
    if engine == "fitserve":
        output_tokens, elapsed = timed_offline_run(llm, workload)
    else:  # the same passes on vLLM: 2 tokens each (compiles, caches), the prefix cache reset, then timed
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        llm.reset_prefix_cache()
        params = [
            SamplingParams(temperature=workload.temperature, max_tokens=r.max_tokens, ignore_eos=True)
            for r in workload.requests
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "out_tok_per_s": round(output_tokens / elapsed, 1),
        "seconds": round(elapsed, 3),
        "requests": len(workload.requests),
    }


def apply_kernel_setting(setting: str) -> None:
    """MODULE.NAME=VALUE: fitserve.kernels.MODULE's NAME set to the Python literal VALUE."""
    target, _, value = setting.partition("=")
    module, _, name = target.rpartition(".")
    kernels = importlib.import_module(f"fitserve.kernels.{module}")
    if not value or not hasattr(kernels, name):
        raise SystemExit(f"--kernel-setting {setting!r}: fitserve.kernels.{module} has no {name!r} to set")
    setattr(kernels, name, ast.literal_eval(value))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("one")
    one.add_argument("--format", choices=sorted(FLAGS), required=True)
    one.add_argument("--figure", required=True, help="single, b<batch> (b64, b4, ...) or equal")
    one.add_argument("--model", default="llama-3.1-8b")
    one.add_argument("--engine", choices=["fitserve", "vllm"], default="fitserve")
    one.add_argument("--json-out", required=True)
    one.add_argument(
        "--kernel-setting",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a constant of a fitserve.kernels module first (e.g. int4_gemm.MMA_PROGRAMS_PER_SM=5)",
    )
    every = sub.add_parser("all")
    every.add_argument("--formats", default="bf16,int4,fp8,bnb4")
    every.add_argument("--figures", default="single,b64")
    every.add_argument("--engine", choices=["fitserve", "vllm"], default="fitserve")
    every.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.command == "one":
        for setting in args.kernel_setting:
            apply_kernel_setting(setting)
        result = run_one(args.format, args.figure, args.model, args.engine)
        Path(args.json_out).write_text(json.dumps(result))
        return
    figures: dict = {"machine_extra": machine(), "engine": args.engine}
    for figure in args.figures.split(","):
        for fmt in args.formats.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json") as result:
                command = [sys.executable, __file__, "one", "--format", fmt, "--figure", figure]
                command += ["--engine", args.engine]
                done = subprocess.run(command + ["--json-out", result.name], check=False)
                text = Path(result.name).read_text() if done.returncode == 0 else ""
            figures[f"{fmt}_{figure}"] = json.loads(text) if text else {"error": f"rc {done.returncode}"}
            print(fmt, figure, figures[f"{fmt}_{figure}"], flush=True)
    keys = {}
    for fmt, key in (("bf16", "bf16"), ("int4", "int4"), ("fp8", "fp8"), ("bnb4", "bnb4")):
        single = figures.get(f"{fmt}_single", {})
        if "tok_per_s" in single:
            keys[f"{key}_single8b_tok_per_s"] = single["tok_per_s"]
            if "roofline_frac" in single:  # fitserve's (the bytes are its model's)
                keys[f"{key}_single8b_roofline_frac"] = single["roofline_frac"]
        for figure, result in figures.items():
            batch = figure.removeprefix(f"{fmt}_b")
            if figure.startswith(f"{fmt}_b") and batch.isdigit() and "decode_ms" in result:
                keys[f"{key}_b{batch}_decode_ms"] = result["decode_ms"]
        equal = figures.get(f"{fmt}_equal", {})
        if "out_tok_per_s" in equal:
            keys[f"{key}_equal_out_tok_per_s"] = equal["out_tok_per_s"]
    figures["keys"] = keys
    save("quant" if args.engine == "fitserve" else "quant_vllm", figures, args.out)


if __name__ == "__main__":
    main()
