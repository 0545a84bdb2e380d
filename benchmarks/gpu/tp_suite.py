"""Issue 30's speed figures for tensor and pipeline parallel (dummy weights, the GPUs of one machine).

Each figure runs in its own process (`one`), so one engine's GPU memory is gone before the next starts;
`all` runs them in turn and writes one results file.

  python benchmarks/gpu/tp_suite.py all [--figures single8b_tp1,single8b_tp2,...] [--out FILE]
  python benchmarks/gpu/tp_suite.py one --figure single8b_tp2

Figures:
- single<model>_tp<N>: batch-1 decode, 128 tokens in, 256 out (best of 3 after a warm-up), output tok/s
  and its fraction of the weight-streaming roofline: the bytes one rank's decode step reads (its
  parameters but the input embedding rows) over one GPU's device-to-device copy bandwidth measured in
  the run (every rank streams its part at once).
- equal<model>_tp<N>: 256 requests of 512 random prompt tokens and 512 output tokens, offline, output tok/s.
- kv<model>_tp<N>: the KV cache at max_model_len 131072 and gpu_memory_utilization 0.9 (0.95 for Gemma-4
  31B, as its field report runs it), with `fitserve serve`'s step budget on a GPU (1024 tokens: a sliding
  layer holds its window plus one step's tokens per request): the tokens it holds and its max concurrency
  at that length; nothing is generated.
- greedy<model>_tp<N>: 8 prompts of 256 random tokens, 96 greedy tokens each, with each position's top-2
  logprobs. `all` compares each greedy figure at TP > 1 with the TP 1 one of the same run
  (`greedy_agreement`): prompts whose tokens are identical, and for each that diverges the position and the
  TP 1 top-2 margin there (bf16 sums in another order flip near-ties, so a divergence counts against TP only
  where that margin exceeds CLEAR_MARGIN). Greedy paths amplify a flipped near-tie (a MoE router's top-k
  included), so each greedy figure also scores one fixed path, 8 sequences of 352 random tokens, with
  prompt_logprobs (teacher forcing: every TP size sees the same tokens); `_vs_tp1` adds the largest and mean
  difference of each position's logprob and the positions whose top-1 differs where TP 1's top-2 margin
  exceeds CLEAR_MARGIN.
- a trailing `_ep` adds --enable-expert-parallel (Gemma-4 26B-A4B: each rank holds E/N whole experts).
- `_pp<M>` after the TP size adds --pipeline-parallel-size M (tp x M GPUs; Llama / Qwen families only):
  single8b_tp1_pp2, equal8b_tp1_pp2, greedy8b_tp1_pp2. Its single figure reports no roofline (the stages
  stream their layers one after another, on different GPUs); `all` adds `<figure>_vs_tp<M>`, the ratio of
  its tok/s to the same figure at TP M (tp x M GPUs either way), and compares its greedy figure with TP 1's.
  Issue 30's PP comparison: --figures single8b_tp1,single8b_tp2,single8b_tp1_pp2,equal8b_tp2,equal8b_tp1_pp2,
  greedy8b_tp1,greedy8b_tp1_pp2
Models: 8b = Llama-3.1-8B, 70b = Llama-3.3-70B, g31 = Gemma-4 31B, g26 = Gemma-4 26B-A4B, ge4 = Gemma-4 E4B
shapes. Single figures run at max_model_len 4096, equal ones at 1024.
For a mixture of experts the roofline counts the experts a batch-1 token reads on average (top-k of E).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from common import (  # noqa: I001
    MODELS,
    TOKENIZER,
    batch1_decode_seconds,
    copy_bandwidth_bytes_per_s,
    machine,
    run_figure_process,
    save,
)

SHAPES = {
    "8b": "llama-3.1-8b",
    "70b": "llama-3.3-70b",
    "g31": "gemma-4-31b-it",
    "g26": "gemma-4-26b-a4b-it",
    "ge4": "gemma-4-e4b-it",
}
DEFAULT_FIGURES = "single8b_tp1,single8b_tp2,single70b_tp2,equal70b_tp2"
# Top-2 logprob margin above which bf16 noise does not flip a greedy choice (as tests/gpu's).
CLEAR_MARGIN = 0.5


def parse(figure: str) -> tuple[str, str, int, bool]:
    kind = next((k for k in ("single", "equal", "kv", "greedy") if figure.startswith(k)), "equal")
    expert_parallel = figure.endswith("_ep")
    model, tp = figure[len(kind) :].removesuffix("_ep").split("_pp")[0].split("_tp")
    return kind, model, int(tp), expert_parallel


def stages_of(figure: str) -> int:
    """The pipeline stages a figure runs (`_pp<M>`; 1 without)."""
    rest = figure.removesuffix("_ep")
    return int(rest.rsplit("_pp", 1)[1]) if "_pp" in rest else 1


def rank_step_bytes(model, experts_read: float = 1.0) -> int:
    """Bytes rank 0's decode step streams: its parameters (and a quantized layer's weight buffers) but the
    input embedding tables, expert weights counted at the share of them one token reads (`experts_read`:
    top-k / E)."""
    total = 0.0
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # a quantized layer's weights live in buffers once repacked (int4_*, nf4_*, fp8_*)
    buffers = ((n, b) for n, b in model.named_buffers() if any(t in n for t in ("int4_", "nf4_", "fp8_")))
    for name, param in [*model.named_parameters(), *buffers]:
        size = param.numel() * param.element_size()
        if "embed_tokens" in name and not (tied and name.endswith("model.embed_tokens.weight")):
            continue
        total += size * (experts_read if ".experts." in name else 1.0)
    return int(total)


def experts_read_per_token(llm) -> float:
    """top-k / E from the model's config (1.0 for a dense model)."""
    text = llm.engine.config.model.hf_config
    text = getattr(text, "text_config", None) or text
    experts = getattr(text, "num_experts", None)
    top_k = getattr(text, "top_k_experts", None) or getattr(text, "num_experts_per_tok", None)
    return top_k / experts if experts and top_k else 1.0


def single_figures(llm, rng: random.Random, step_bytes: int | None) -> dict:
    """Batch-1 decode (batch1_decode_seconds) against the weight-streaming roofline: `step_bytes` a step
    reads over the copy bandwidth measured now (None: no roofline)."""
    times = batch1_decode_seconds(llm, rng)
    tok_per_s = 256 / min(times)
    if step_bytes is None:
        return {"tok_per_s": round(tok_per_s, 1), "seconds_per_request": [round(t, 3) for t in times]}
    bandwidth = copy_bandwidth_bytes_per_s()
    roofline = bandwidth / step_bytes
    return {
        "tok_per_s": round(tok_per_s, 1),
        "seconds_per_request": [round(t, 3) for t in times],
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "roofline_tok_per_s": round(roofline, 1),
        "roofline_frac": round(tok_per_s / roofline, 3),
    }


def equal_figures(llm, rng: random.Random) -> dict:
    """The equal workload: 256 requests of 512 random prompt tokens and 512 greedy output tokens."""
    from fitserve import SamplingParams

    prompts = [{"prompt_token_ids": [rng.randint(0, 30000) for _ in range(512)]} for _ in range(256)]
    params = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "out_tok_per_s": round(tokens / elapsed, 1),
        "seconds": round(elapsed, 1),
        "output_tokens": tokens,
    }


def greedy_figures(llm, rng: random.Random) -> dict:
    """8 prompts of 256 random tokens, 96 greedy tokens each, and each position's top-2 margin."""
    from fitserve import SamplingParams

    prompts = [{"prompt_token_ids": [rng.randint(0, 30000) for _ in range(256)]} for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens, margins = [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens.append(list(completion.token_ids))
        margins.append([round(_top2_margin(position), 4) for position in completion.logprobs])
    return {"tokens": tokens, "margins": margins, **teacher_forced_figures(llm, rng)}


def teacher_forced_figures(llm, rng: random.Random) -> dict:
    """Each position's logprob of the given token, top-1 id and top-2 margin over 8 fixed 352-token paths."""
    from fitserve import SamplingParams

    paths = [{"prompt_token_ids": [rng.randint(0, 30000) for _ in range(352)]} for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    logprobs, top1, margins = [], [], []
    for path, output in zip(paths, llm.generate(paths, params, use_tqdm=False)):
        for token, position in zip(path["prompt_token_ids"][1:], output.prompt_logprobs[1:]):
            logprobs.append(round(position[token].logprob, 4))
            best = max(position.items(), key=lambda item: item[1].logprob)[0]
            top1.append(best)
            margins.append(round(_top2_margin(position), 4))
    return {"forced_logprobs": logprobs, "forced_top1": top1, "forced_margins": margins}


def _top2_margin(position: dict) -> float:
    values = sorted((entry.logprob for entry in position.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def greedy_agreement(figures: dict) -> dict[str, dict]:
    """`<greedy figure>_vs_tp1` for each greedy figure at TP > 1 whose TP 1 figure ran: identical prompts,
    and each divergence's position and TP 1 margin."""
    greedy = {k: v for k, v in figures.items() if isinstance(v, dict) and "tokens" in v}
    agreement = {}
    for name, figure in greedy.items():
        _, model, tp, _ = parse(name)
        base = greedy.get(f"greedy{model}_tp1")
        if (tp == 1 and stages_of(name) == 1) or not base:
            continue
        divergences = []
        for ours, theirs, margins in zip(figure["tokens"], base["tokens"], base["margins"]):
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if at is not None:
                divergences.append({"position": at, "tp1_margin": margins[at]})
        agreement[f"{name}_vs_tp1"] = {
            "prompts": len(base["tokens"]),
            "identical": len(base["tokens"]) - len(divergences),
            "divergences": divergences,
            "clear_margin_divergences": sum(d["tp1_margin"] > CLEAR_MARGIN for d in divergences),
            **forced_agreement(figure, base),
        }
    return agreement


def forced_agreement(figure: dict, base: dict) -> dict:
    """The teacher-forced paths at TP N against TP 1: logprob differences and top-1 disagreements."""
    if "forced_logprobs" not in figure or "forced_logprobs" not in base:
        return {}
    diffs = [abs(a - b) for a, b in zip(figure["forced_logprobs"], base["forced_logprobs"])]
    pairs = zip(figure["forced_top1"], base["forced_top1"], base["forced_margins"])
    flips = [margin for ours, theirs, margin in pairs if ours != theirs]
    return {
        "forced_positions": len(diffs),
        "forced_max_abs_logprob_diff": round(max(diffs), 4),
        "forced_mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 5),
        "forced_top1_flips": len(flips),
        "forced_clear_margin_top1_flips": sum(m > CLEAR_MARGIN for m in flips),
    }


def run_one(figure: str) -> dict:
    from fitserve import LLM

    kind, model, tp, expert_parallel = parse(figure)
    stages = stages_of(figure)
    started = time.perf_counter()
    llm = LLM(
        str(MODELS / SHAPES[model]),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len={"single": 4096, "equal": 1024, "kv": 131072, "greedy": 1024}[kind],
        tensor_parallel_size=tp,
        pipeline_parallel_size=stages,
        enable_expert_parallel=expert_parallel,
        gpu_memory_utilization=(0.95 if model == "g31" else 0.9) if kind == "kv" else 0.92,
        **({"max_num_batched_tokens": 1024} if kind == "kv" else {}),
    )
    ready_s = time.perf_counter() - started
    rng = random.Random(0)
    result = {
        "figure": figure,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": stages,
        "enable_expert_parallel": expert_parallel,
        "ready_s": round(ready_s, 1),
    }
    result["kv_cache_tokens_per_rank"] = llm.engine.memory_plan.kv_cache_tokens
    if kind == "kv":
        result["max_concurrency"] = round(llm.engine.memory_plan.max_concurrency, 2)
    elif kind == "single" and stages > 1:  # rank 0 holds one stage: its bytes are not a step's
        result.update(single_figures(llm, rng, None))
    elif kind == "single":
        step_bytes = rank_step_bytes(llm.engine.executor.runner.model, experts_read_per_token(llm))
        result.update(single_figures(llm, rng, step_bytes), rank_step_bytes=step_bytes)
    elif kind == "greedy":
        result.update(greedy_figures(llm, rng))
    else:
        result.update(equal_figures(llm, rng))
    print("RESULT " + json.dumps(result), flush=True)
    llm.engine.shutdown()
    return result


def speedups_over_tp1(figures: dict) -> dict[str, float]:
    """`<single figure>_speedup_over_tp1` for each single figure at TP > 1 whose TP 1 figure ran."""
    single = {k: v for k, v in figures.items() if isinstance(v, dict) and "tok_per_s" in v}
    speedups = {}
    for name, figure in single.items():
        _, model, tp, _ = parse(name)
        base = single.get(f"single{model}_tp1")
        if (tp > 1 or stages_of(name) > 1) and base:
            speedups[f"{name}_speedup_over_tp1"] = round(figure["tok_per_s"] / base["tok_per_s"], 3)
    return speedups


def pipeline_vs_tensor(figures: dict) -> dict[str, float]:
    """`<figure>_vs_tp<N>` for each single or equal figure at TP t x PP M whose TP t*M figure ran (as many
    GPUs): the ratio of their output tok/s (above 1: pipeline parallel is faster)."""
    ratios = {}
    for name, figure in figures.items():
        stages = stages_of(name)
        if stages == 1 or not isinstance(figure, dict):
            continue
        kind, model, tp, expert_parallel = parse(name)
        key = "tok_per_s" if kind == "single" else "out_tok_per_s"
        base = figures.get(f"{kind}{model}_tp{tp * stages}{'_ep' if expert_parallel else ''}")
        if isinstance(base, dict) and key in figure and key in base:
            ratios[f"{name}_vs_tp{tp * stages}"] = round(figure[key] / base[key], 3)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["all", "one"])
    parser.add_argument("--figure", default="single8b_tp2")
    parser.add_argument("--figures", default=DEFAULT_FIGURES)
    parser.add_argument("--out", default=None)
    parser.add_argument("--figure-timeout-s", type=float, default=600)
    args = parser.parse_args()
    if args.mode == "one":
        run_one(args.figure)
        return
    figures = {}
    for figure in args.figures.split(","):
        figures[figure] = run_figure_process(__file__, ["one", "--figure", figure], args.figure_timeout_s)
        print(figure, json.dumps(figures[figure]), flush=True)
    figures.update(speedups_over_tp1(figures))
    figures.update(pipeline_vs_tensor(figures))
    figures.update(greedy_agreement(figures))
    out = args.out or str(Path(__file__).resolve().parents[1] / "results" / "h100x2_tp.json")
    save("tp_suite", {"machine_detail": machine(), **figures}, out)


if __name__ == "__main__":
    main()
