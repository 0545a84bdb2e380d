"""CPU speed: SmolLM2-135M-Instruct, greedy, 128 new tokens; fitserve against HF transformers.

Measures in one run on the same machine:
  - HF transformers `generate`, single stream (batch 1);
  - fitserve, single stream;
  - fitserve, 16 prompts at once.
Goal (issue 2): fitserve single stream >= 3x HF's; 16 prompts >= 10x HF's single-stream tokens/s.
HF is measured twice: as `from_pretrained` loads it by default (the config's dtype, bfloat16, which
this CPU has no fast instructions for) and in float32, fitserve's CPU default.

Every measurement runs `--repeats` times, the four interleaved (HF default, HF float32, fitserve single,
fitserve 16), so a burst of other load on a shared machine hits all of them alike; the speedups use each
one's best run, and every run is kept in the JSON with the load average before it.

The C kernel set that ran (avx512, avx_vnni, avx2, or none: torch's operations) is recorded under
"cpu_kernel_set"; `--kernels avx2` forces one (it sets FITSERVE_CPU_KERNELS before the engine starts), e.g.
to measure the AVX2 kernels on a machine that also has AVX-512. `--no-hf-default` skips HF's bfloat16 run
(the comparison is against HF in float32) to keep a run short on a shared machine. To stand in for an
AVX2-only CPU on the HF side too, hold torch's own kernels and its libraries to AVX2 through their
variables: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (the JSON records
them and the capability torch ran with).

Usage: python benchmarks/cpu_smollm2.py [--out benchmarks/results/cpu_smollm2.json] [--repeats 3]
           [--kernels auto|avx512|avx_vnni|avx2|torch] [--no-hf-default]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time

import torch
import transformers

NEW_TOKENS = 128
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright while moving.",
    "List some good habits for writing clean Python code.",
    "What are the main differences between a comet and an asteroid?",
    "Describe the water cycle to a ten year old.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue during the day and red at sunset?",
    "Summarize the plot of a detective novel you would like to read.",
    "How do vaccines train the immune system?",
    "What should I pack for a three day hiking trip?",
    "Explain what a hash table is and when to use one.",
    "Write a polite email asking a colleague for feedback.",
    "What are the benefits of learning a second language?",
    "Describe how a refrigerator keeps food cold.",
    "Give tips for a first job interview.",
    "What is the difference between weather and climate?",
]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def load_hf(model_path: str, dtype: torch.dtype | None):
    """HF's model, warmed up. dtype None: what from_pretrained loads by default (the config's dtype)."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.eval()
    with torch.inference_mode():
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    return model


def bench_hf(model, prompt_ids: list[int]) -> dict:
    """HF `generate`, batch 1."""
    inputs = torch.tensor([prompt_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        elapsed = time.perf_counter() - start
    generated = out.shape[1] - len(prompt_ids)
    return {
        "dtype": str(model.dtype),
        "tokens": generated,
        "seconds": elapsed,
        "tok_per_s": generated / elapsed,
    }


def bench_fitserve(llm, prompts_ids: list[list[int]]) -> dict:
    from fitserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts_ids[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts_ids], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "prompts": len(prompts_ids),
        "tokens": generated,
        "seconds": elapsed,
        "tok_per_s": generated / elapsed,
    }


def best_of(runs: list[dict]) -> dict:
    """The fastest run, with every run's tok/s and the load average before it."""
    best = dict(max(runs, key=lambda run: run["tok_per_s"]))
    best["runs_tok_per_s"] = [round(run["tok_per_s"], 2) for run in runs]
    best["runs_load_avg_1min"] = [run["load_avg_1min"] for run in runs]
    best.pop("load_avg_1min")
    return best


def weight_formats(llm) -> dict:
    """How fitserve holds the model's matrices on this device (see docs/engine.md, CPU speed)."""
    model = llm.engine.executor.runner.model
    linears = collections.Counter(
        type(m.linear_method).__name__ for m in model.modules() if hasattr(m, "linear_method")
    )
    head = model.lm_head
    head_format = (
        "float16 (exact copy)" if getattr(head, "_fp16_weight", None) is not None else str(head.weight.dtype)
    )
    fp16_copies = sum(getattr(m, "fp16_weight", None) is not None for m in model.modules())
    from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels
    from fitserve.layers.cpu.int4_linear import FP16_MIN_ROWS

    kernels = load_cpu_kernels()
    formats = {
        "linear_methods": dict(linears),
        "cpu_kernels": "not built here" if kernels is None else f"built ({kernels.path.name})",
        "cpu_kernel_set": kernel_set_name(kernels),
        "int4_layers_with_fp16_copy": fp16_copies,
        "lm_head": head_format,
    }
    if fp16_copies:
        formats["fp16_copy_from_rows"] = FP16_MIN_ROWS
    return formats


def kernel_set_name(kernels) -> str:
    """The C kernel set that runs ("torch" where none does: torch's operations)."""
    return "torch" if kernels is None else kernels.set_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/cpu_smollm2.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--kernels",
        default=None,
        help="the C kernel set to force (FITSERVE_CPU_KERNELS): auto, avx512, avx_vnni, avx2 or torch; "
        "default: as the environment says (unset: the best this CPU has)",
    )
    parser.add_argument(
        "--no-hf-default", action="store_true", help="skip HF in its default dtype (bfloat16): shorter runs"
    )
    args = parser.parse_args()
    if args.kernels is not None:
        os.environ["FITSERVE_CPU_KERNELS"] = args.kernels
    from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels

    kernels = load_cpu_kernels()
    if args.kernels not in (None, "auto", "torch", "0") and kernels is None:
        from fitserve.layers.cpu.c_kernels.library import unavailable_reason

        sys.exit(f"--kernels {args.kernels}: not available here ({unavailable_reason()})")

    from fitserve import LLM

    llm = LLM(enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    prompts_ids = [chat_ids(tokenizer, p) for p in PROMPTS]
    model_path = llm.engine.config.model.model_path
    hf_models = {"hf_float32": load_hf(model_path, torch.float32)}
    if not args.no_hf_default:
        hf_models["hf_default"] = load_hf(model_path, None)
    cases = {
        "hf_default": lambda: bench_hf(hf_models["hf_default"], prompts_ids[0]),
        "hf_float32": lambda: bench_hf(hf_models["hf_float32"], prompts_ids[0]),
        "fitserve_single": lambda: bench_fitserve(llm, prompts_ids[:1]),
        "fitserve_16": lambda: bench_fitserve(llm, prompts_ids),
    }
    if args.no_hf_default:
        del cases["hf_default"]
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, case in cases.items():
            load = round(os.getloadavg()[0], 2)
            runs[name].append({**case(), "load_avg_1min": load})
            print(f"{name}: {runs[name][-1]['tok_per_s']:.1f} tok/s (load {load})", file=sys.stderr)
    hf_default = best_of(runs["hf_default"]) if "hf_default" in runs else None
    hf = best_of(runs["hf_float32"])
    single, batch16 = best_of(runs["fitserve_single"]), best_of(runs["fitserve_16"])
    result = {
        "benchmark": "cpu_smollm2",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_limits": {
                name: os.environ[name]
                for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                if name in os.environ
            },
        },
        "model": llm.engine.config.model.model_source,
        "cpu_kernel_set": kernel_set_name(load_cpu_kernels()),
        "cpu_kernels_requested": os.environ.get("FITSERVE_CPU_KERNELS", "auto (unset)"),
        "dtype": str(llm.engine.config.model.dtype),
        "weight_formats": weight_formats(llm),
        "new_tokens": NEW_TOKENS,
        "repeats": args.repeats,
        "note": "each entry is the best of `repeats` runs; runs_tok_per_s lists them all (shared machine)",
        "hf_single_stream_default_dtype": hf_default,
        "hf_single_stream": hf,
        "fitserve_single_stream": single,
        "fitserve_16_prompts": batch16,
        "single_stream_speedup_vs_hf": single["tok_per_s"] / hf["tok_per_s"],
        "batch16_speedup_vs_hf_single": batch16["tok_per_s"] / hf["tok_per_s"],
    }
    if hf_default is not None:
        result["single_stream_speedup_vs_hf_default_dtype"] = single["tok_per_s"] / hf_default["tok_per_s"]
        result["batch16_speedup_vs_hf_default_dtype_single"] = batch16["tok_per_s"] / hf_default["tok_per_s"]
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
