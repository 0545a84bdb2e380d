"""Issue 30's tensor-parallel figures on one engine, fitserve or vLLM, with the same settings, for a
same-lease ratio ("compared with vLLM 0.26 at TP 2 on the same machine kind").

Figures (dummy weights, the SmolLM2 tokenizer, gpu_memory_utilization 0.9, CUDA graphs as each engine
defaults), each in its own process (one engine's memory is gone before the next starts):
- single<model>_tp<N>: batch-1 decode, 128 random prompt tokens and 256 greedy output tokens, best of 3
  after one warm-up request, output tok/s (max_model_len 4096);
- equal<model>_tp<N>: 256 requests of 512 random prompt tokens and 512 output tokens at once, output tok/s
  (max_model_len 1024), after a pass that gives every prompt 2 tokens (kernel variants, compile caches).
Models: 8b = Llama-3.1-8B, 70b = Llama-3.3-70B (shared/models), 30ba3b = Qwen3-30B-A3B (the MoE shape
vLLM 0.26.0 loads on the GPU machine, unlike Gemma-4's and Qwen3.6's; examples/models), 30ba3bawq = the same
as an AWQ int4 checkpoint (its int4 experts: fitserve's kernels/fused_moe_int4.py and moe_int4_decode.py,
vLLM's Marlin MoE), 30ba3bfp8 = as Qwen's FP8 checkpoint ([128, 128] blocks: fitserve's
kernels/fused_moe_fp8.py). vLLM needs compressed-tensors beside its bundle for both quantized forms
(benchmarks/results/h200_quant_vs_vllm.json says how).
Also ready_s (constructor to ready).

  python benchmarks/gpu/tp_vs_vllm.py --engine vllm|fitserve [--figures single8b_tp2,...] --out FILE
vLLM 0.26.0 from ../shared/vllm_bundle (PYTHONPATH with its site folder).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from common import (  # noqa: I001
    MODELS,
    REPO,
    TOKENIZER,
    engine_classes,
    engine_generate,
    engine_single_request,
    run_figure_process,
    save,
)

SHAPES = {
    "8b": MODELS / "llama-3.1-8b",
    "70b": MODELS / "llama-3.3-70b",
    "30ba3b": REPO / "examples" / "models" / "qwen3-30b-a3b",
    "30ba3bawq": REPO / "examples" / "models" / "qwen3-30b-a3b-awq",
    "30ba3bfp8": REPO / "examples" / "models" / "qwen3-30b-a3b-fp8",
}
DEFAULT_FIGURES = "single8b_tp1,single8b_tp2,single70b_tp2,equal70b_tp2"


def parse(figure: str) -> tuple[str, str, int]:
    kind = "single" if figure.startswith("single") else "equal"
    model, tp = figure[len(kind) :].split("_tp")
    return kind, model, int(tp)


def run_one(engine: str, figure: str) -> dict:
    kind, model, tp = parse(figure)
    started = time.monotonic()
    LLM, SamplingParams = engine_classes(engine)
    llm = LLM(
        str(SHAPES[model]),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        tensor_parallel_size=tp,
        max_model_len=4096 if kind == "single" else 1024,
        gpu_memory_utilization=0.9,
    )
    figures: dict = {"figure": figure, "ready_s": round(time.monotonic() - started, 1)}
    rng = random.Random(0)

    if kind == "single":
        tok_per_s, times = engine_single_request(llm, SamplingParams, rng)
        figures["tok_per_s"] = round(tok_per_s, 1)
        figures["seconds_per_request"] = [round(t, 3) for t in times]
    else:
        prompts = [[rng.randint(0, 10000) for _ in range(512)] for _ in range(256)]
        engine_generate(llm, SamplingParams, prompts, 2)
        seconds, tokens = engine_generate(llm, SamplingParams, prompts, 512)
        figures["out_tok_per_s"] = round(tokens / seconds, 1)
        figures["seconds"] = round(seconds, 2)
    print("RESULT " + json.dumps(figures), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["fitserve", "vllm"], required=True)
    parser.add_argument("--figures", default=DEFAULT_FIGURES)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=420)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.one:
        run_one(args.engine, args.one)
        return
    figures: dict = {"engine": args.engine}
    if args.engine == "vllm":
        import vllm

        figures["vllm"] = vllm.__version__
    for figure in args.figures.split(","):
        one = ["--engine", args.engine, "--one", figure]
        figures[figure] = run_figure_process(__file__, one, args.timeout_s)
        print(figure, json.dumps(figures[figure])[:400], flush=True)
    save(f"tp_vs_vllm_{args.engine}", figures, args.out)


if __name__ == "__main__":
    main()
