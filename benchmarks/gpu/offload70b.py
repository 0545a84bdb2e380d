"""A 70B model on a small GPU: the DeepSeek-R1-Distill-Llama-70B shape (dummy weights) in int4 (GPTQ group
128) or bitsandbytes nf4, with --gpu-memory-utilization set so the engine gets 24 GiB of this GPU and the
--cpu-offload-gb that `fitserve plan` advises for that budget.

It records `fitserve plan`'s advice and its prediction (weights per GPU, offloaded bytes, host RAM) beside
what the engine measured, the host-to-device copy bandwidth from page-locked memory (measured in the same
run, `h2d_gb_per_s`), and batch-1 decode: tok/s over 32 tokens after a 64-token prompt, against the limit
the offloaded bytes over that bandwidth allow (every decode step copies every offloaded layer in).

  python benchmarks/gpu/offload70b.py --format int4 [--budget-gib 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import MODELS, TOKENIZER, save  # noqa: I001

GiB = 1 << 30
GPTQ_128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
FLAGS = {"int4": [], "bnb4": ["--quantization", "bitsandbytes"]}
# The plan and the engine are given the same scheduler settings (a single user's server on a small GPU).
MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 2048


def h2d_bytes_per_s(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    import torch

    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / repeats
    del host, device
    torch.cuda.empty_cache()
    return num_bytes / elapsed


def model_folder(fmt: str, scratch: Path) -> Path:
    folder = scratch / f"r1-70b-{fmt}"
    shutil.copytree(MODELS / "deepseek-r1-distill-llama-70b", folder)
    if fmt == "int4":
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = GPTQ_128
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def advised_offload_gb(folder: Path, fmt: str, gmu: float, total_gib: float) -> tuple[float, str]:
    """`fitserve plan`'s --cpu-offload-gb for this budget (its "What would fit" line) and its output."""
    command = [sys.executable, "-m", "fitserve", "plan", str(folder), "--load-format", "dummy"]
    command += ["--gpu-memory-utilization", f"{gmu:.4f}", "--assume-gpus", f"1x{total_gib:.2f}@9.0"]
    command += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    done = subprocess.run(command + FLAGS[fmt], capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    match = re.search(r"--cpu-offload-gb ([\d.]+)", text)
    if match is None:
        raise SystemExit(f"fitserve plan gave no --cpu-offload-gb advice:\n{text}")
    return float(match.group(1)), text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", choices=sorted(FLAGS), default="int4")
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    from fitserve import LLM, SamplingParams
    from fitserve.planner.engine_plan import gpu_device_spec, inputs_from_engine_config
    from fitserve.planner.memory import plan_memory

    total_gib = torch.cuda.get_device_properties(0).total_memory / GiB
    gmu = args.budget_gib / total_gib
    bandwidth = h2d_bytes_per_s()
    with tempfile.TemporaryDirectory() as scratch:
        folder = model_folder(args.format, Path(scratch))
        offload_gb, plan_text = advised_offload_gb(folder, args.format, gmu, total_gib)
        start = time.perf_counter()
        llm = LLM(
            str(folder),
            tokenizer=str(TOKENIZER),
            load_format="dummy",
            max_model_len=4096,
            gpu_memory_utilization=gmu,
            cpu_offload_gb=offload_gb,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            quantization=FLAGS[args.format][1] if FLAGS[args.format] else None,
        )
        ready_s = time.perf_counter() - start
    runner = llm.engine.executor.runner
    offload = runner.model.cpu_offload
    plan = plan_memory(inputs_from_engine_config(llm.engine.config, gpu_device_spec(0)))
    prompt = {"prompt_token_ids": list(range(1000, 1064))}

    def timed(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        begin = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == tokens
        return time.perf_counter() - begin

    timed(2)  # warm-up
    short = min(timed(1) for _ in range(2))
    long = timed(33)
    tok_per_s = 32 / (long - short)
    limit = bandwidth / offload.offloaded_bytes
    answer = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8), use_tqdm=False)
    save(
        f"offload70b_{args.format}",
        {
            "model": "deepseek-r1-distill-llama-70b (shape, dummy weights)",
            "format": args.format,
            "gpu_memory_utilization": round(gmu, 4),
            "engine_budget_gib": args.budget_gib,
            "plan_advice_cpu_offload_gb": offload_gb,
            "plan_output": plan_text.strip().splitlines(),
            "planned": {
                "weights_gpu_gib": round(plan.terms.weights / GiB, 2),
                "weights_offloaded_gib": round(plan.weights_offloaded_bytes / GiB, 2),
                "offloaded_layers": plan.offload.num_layers,
                "host_gib": round(plan.offload.host_bytes / GiB, 2),
                "kv_tokens": plan.kv_cache_tokens,
            },
            "measured": {
                "weights_gpu_gib": round(runner.platform.weights_bytes / GiB, 2),
                "weights_offloaded_gib": round(offload.offloaded_bytes / GiB, 2),
                "offloaded_layers": len(offload.layers),
                "host_gib": round(offload.host_bytes / GiB, 2),
                "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
            },
            "ready_s": round(ready_s, 1),
            "h2d_gb_per_s": round(bandwidth / 1e9, 2),
            "decode_tok_per_s": round(tok_per_s, 3),
            "pcie_limit_tok_per_s": round(limit, 3),
            "frac_of_limit": round(tok_per_s / limit, 3),
            "answer_tokens": len(answer[0].outputs[0].token_ids),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
