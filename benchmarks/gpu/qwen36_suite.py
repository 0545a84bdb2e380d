"""Qwen3.6 hybrids' speed figures on one GPU (dummy weights): Qwen3.6-27B (dense) and Qwen3.6-35B-A3B (MoE)
shapes, decode steps in CUDA graphs (the Gated DeltaNet layers' state slots in the graphs' buffers).

Each figure runs in its own process (`one`), so one engine's GPU memory is gone before the next starts;
`all` runs them in turn and writes one results file (benchmarks/results/h100_qwen36.json by default).

  python benchmarks/gpu/qwen36_suite.py all [--figures single27b,single35b,equal27b,equal35b] [--out FILE]
  python benchmarks/gpu/qwen36_suite.py one --figure single27b
  python benchmarks/gpu/qwen36_suite.py all --figures equal35b --append   # add to the results file

(--append keeps the figures already in the results file: one figure per call fits a time-limited shell.)

Figures:
- single<model>: batch-1 decode, 128 tokens in, 256 out (best of 3 after a warm-up), output tok/s and its
  fraction of the weight-streaming roofline: the bytes a decode step reads (the parameters but the input
  embedding rows, experts at top-k / E, as benchmarks/gpu/tp_suite.py counts them, plus the one request's
  recurrent state, read and written once per step) over the device-to-device copy bandwidth measured in
  the run. max_model_len 4096.
- equal<model>: 256 requests of 512 random prompt tokens and 512 output tokens, offline, output tok/s
  (max_model_len 1024, max_num_seqs --equal-max-num-seqs: 64 by default, the most an H100 holds beside
  either model's weights with the decode graphs; an H200 fits 256).
- a trailing `_eager` runs the figure with --enforce-eager (the same steps without CUDA graphs).
Models: 27b = Qwen3.6-27B, 35b = Qwen3.6-35B-A3B, 27bint4 = Qwen3.6-27B-AWQ-INT4 (shared/models/qwen3.6-27b,
qwen3.6-35b-a3b, qwen3.6-27b-awq-int4; dummy weights in its int4 format). The first two are
large for one H100 (80 GB): 27B's bf16 weights take ~54 GB and 35B-A3B's ~67 GB, and each sequence holds
~150 MB / ~63 MB of recurrent state, so auto-fit lowers what is left unset, the decode graphs among the
first: the single figures run with max_num_seqs 16, and every figure records the settings it ran with
(`cuda_graphs`, `capture_sizes`, `max_num_seqs`).
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
    machine,
    run_figure_process,
    save,
)
from tp_suite import equal_figures, experts_read_per_token, rank_step_bytes, single_figures

SHAPES = {"27b": "qwen3.6-27b", "35b": "qwen3.6-35b-a3b", "27bint4": "qwen3.6-27b-awq-int4"}
DEFAULT_FIGURES = "single27b,single35b,equal27b,equal35b"


def parse(figure: str) -> tuple[str, str, bool]:
    """figure -> (kind, model, eager)."""
    eager = figure.endswith("_eager")
    name = figure.removesuffix("_eager")
    kind = next((k for k in ("single", "equal") if name.startswith(k)), None)
    model = name[len(kind) :] if kind else ""
    if kind is None or model not in SHAPES:
        raise ValueError(
            f"figure {figure!r}: expected single<model> or equal<model> with model in {sorted(SHAPES)} "
            "and an optional _eager suffix (e.g. single27b, equal35b_eager)"
        )
    return kind, model, eager


def state_bytes_per_request(model) -> int:
    """Bytes of one request's recurrent state over all DeltaNet layers (0 without a state pool)."""
    pool = getattr(model, "state_pool", None)
    if pool is None:
        return 0
    tensors = (*pool.conv, *pool.recurrent)
    return sum(t[0].numel() * t.element_size() for t in tensors)


def run_one(figure: str, equal_max_num_seqs: int) -> dict:
    from fitserve import LLM

    kind, model, eager = parse(figure)
    started = time.perf_counter()
    llm = LLM(
        str(MODELS / SHAPES[model]),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=4096 if kind == "single" else 1024,
        max_num_seqs=16 if kind == "single" else equal_max_num_seqs,
        gpu_memory_utilization=0.92,
        enforce_eager=eager,
    )
    ready_s = time.perf_counter() - started
    runner = llm.engine.executor.runner
    config = llm.engine.config
    rng = random.Random(0)
    result = {
        "figure": figure,
        "model": SHAPES[model],
        "cuda_graphs": runner.graph_runner is not None,
        "capture_sizes": runner.graph_runner.capture_sizes if runner.graph_runner is not None else [],
        "max_num_seqs": config.scheduler.max_num_seqs,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "ready_s": round(ready_s, 1),
        "kv_cache_tokens": llm.engine.memory_plan.kv_cache_tokens,
    }
    if kind == "single":
        weight_bytes = rank_step_bytes(runner.model, experts_read_per_token(llm))
        state_bytes = 2 * state_bytes_per_request(runner.model)  # read and written once per step
        result.update(single_figures(llm, rng, weight_bytes + state_bytes))
        result.update(step_weight_bytes=weight_bytes, step_state_bytes=state_bytes)
    else:
        result.update(equal_figures(llm, rng))
    print("RESULT " + json.dumps(result), flush=True)
    llm.engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["all", "one"])
    parser.add_argument("--figure", default="single27b")
    parser.add_argument("--figures", default=DEFAULT_FIGURES)
    parser.add_argument("--out", default=None)
    parser.add_argument("--equal-max-num-seqs", type=int, default=64)
    parser.add_argument("--figure-timeout-s", type=float, default=900)
    parser.add_argument("--append", action="store_true", help="keep the results file's earlier figures")
    args = parser.parse_args()
    if args.mode == "one":
        run_one(args.figure, args.equal_max_num_seqs)
        return
    out = args.out or str(Path(__file__).resolve().parents[1] / "results" / "h100_qwen36.json")
    figures = {}
    if args.append and Path(out).exists():
        figures = json.loads(Path(out).read_text())["figures"]
        figures.pop("machine_detail", None)
    for figure in args.figures.split(","):
        parse(figure)  # a misspelt figure fails before any engine starts
    for figure in args.figures.split(","):
        figure_args = ["one", "--figure", figure, "--equal-max-num-seqs", str(args.equal_max_num_seqs)]
        figures[figure] = run_figure_process(__file__, figure_args, args.figure_timeout_s)
        print(figure, json.dumps(figures[figure]), flush=True)
    for name, figure in list(figures.items()):
        if name.endswith("_graph_speedup"):
            continue
        eager = figures.get(f"{name}_eager")
        key = "tok_per_s" if name.startswith("single") else "out_tok_per_s"
        if not name.endswith("_eager") and eager and key in figure and key in eager:
            figures[f"{name}_graph_speedup"] = round(figure[key] / eager[key], 3)
    save("qwen36_suite", {"machine_detail": machine(), **figures}, out)


if __name__ == "__main__":
    main()
