"""Speculative decoding on a hybrid (Qwen3.6-27B shape, dummy weights, one GPU): what a verify step costs
against a decode step, where the state is kept per verified token (worker/state_rings.py) and the step
runs eagerly (the decode CUDA graphs replay plain decode steps only).

  python benchmarks/gpu/hybrid_spec_bench.py all [--model qwen3.6-27b] [--out FILE]
  python benchmarks/gpu/hybrid_spec_bench.py one --figure NAME --work DIR [--model ...]

Figures (batch 1: 3 requests of 128 random prompt tokens and 128 greedy output tokens, one at a time after
a warm-up, output tok/s of the fastest; batch 8: 8 such requests at once, output tok/s):
- baseline: no speculation (`speculative_config={}`: also no MTP). Its outputs are the oracle's answers.
- oracle: `{"method": "oracle", "num_speculative_tokens": 3}` drafting the baseline's tokens (accepted
  while the verify steps' bf16 sums agree with the decode steps'), with the acceptance: the best case.
- oracle_miss: every draft wrong: the cost of speculation when nothing is accepted (with its back-off).
- verify_step_ms / decode_step_ms: one batch-1 verify step of k + 1 = 4 rows (eager) and one decode
  step (graph replay), timed through the engine's steps; their ratio is what an accepted token must pay
  for.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, TOKENIZER, run_figure_process, save  # noqa: E402

FIGURES = ["baseline", "oracle", "oracle_miss", "step_times"]
K = 3
OUTPUT_TOKENS = 128


def _llm(model: str, **kwargs):
    from fitserve import LLM

    return LLM(
        str(MODELS / model),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=2048,
        max_num_seqs=8,
        gpu_memory_utilization=0.9,
        **kwargs,
    )


def _params(max_tokens: int = OUTPUT_TOKENS):
    from fitserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(0, 30000) for _ in range(128)] for _ in range(11)]


def _run(llm, prompts: list[list[int]]) -> dict:
    """Batch 1 over prompts[:4] (the first a warm-up) and batch 8 over prompts[3:], tok/s and outputs."""
    times, outputs = [], []
    for prompt in prompts[:4]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], _params(), use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        outputs.append(list(out.outputs[0].token_ids))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[3:]], _params(), use_tqdm=False)
    batch8 = time.perf_counter() - start
    outputs += [list(o.outputs[0].token_ids) for o in outs]
    return {
        "batch1_tok_per_s": round(OUTPUT_TOKENS / min(times[1:]), 1),
        "batch8_tok_per_s": round(8 * OUTPUT_TOKENS / batch8, 1),
        "outputs": outputs,
    }


def baseline(work: Path, model: str) -> dict:
    figures = _run(_llm(model, speculative_config={}), _prompts())
    (work / "answers.json").write_text(json.dumps(figures.pop("outputs")))
    return figures


def _oracle(work: Path, model: str, miss: bool) -> dict:
    prompts = _prompts()
    answers = json.loads((work / "answers.json").read_text())
    llm = _llm(model, speculative_config={"method": "oracle", "num_speculative_tokens": K})
    keyed = prompts[:4] + prompts[3:]  # the batch-1 and the batch-8 runs' prompts, in _run's order
    llm.engine.speculator.proposer.load(keyed, answers, llm.engine.config.model.vocab_size, miss=miss)
    figures = _run(llm, prompts)
    stats = llm.engine.speculator.stats
    figures["same_outputs"] = sum(a == b for a, b in zip(figures.pop("outputs"), answers))
    figures["accepted_per_draft"] = round(stats.num_accepted_tokens / max(1, stats.num_draft_tokens), 3)
    figures["mean_acceptance_length"] = round(1 + stats.num_accepted_tokens / max(1, stats.num_drafts), 3)
    return figures


def oracle(work: Path, model: str) -> dict:
    return _oracle(work, model, miss=False)


def oracle_miss(work: Path, model: str) -> dict:
    return _oracle(work, model, miss=True)


def step_times(work: Path, model: str) -> dict:
    """Engine steps of one request, timed from the host (each waits for its tokens): the steps that
    verified the oracle's drafts against the plain decode steps of the same engine with speculation
    paused; the median of each after a warm-up request."""
    prompt = _prompts()[0]
    answers = json.loads((work / "answers.json").read_text())
    llm = _llm(model, speculative_config={"method": "oracle", "num_speculative_tokens": K})
    engine = llm.engine
    speculator = engine.speculator
    speculator.proposer.load([prompt], [answers[0]], engine.config.model.vocab_size)
    timings: dict[str, list[float]] = {"verify": [], "decode": []}
    for run, phase in enumerate(("verify", "decode", "verify", "decode")):
        speculator._pause_left = 10**9 if phase == "decode" else 0  # decode: speculation off
        engine.add_request(f"{phase}{run}", None, prompt, _params(64))
        engine.step()  # the prompt
        while engine.has_unfinished_requests():
            drafts = speculator.stats.num_drafts
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            verified = speculator.stats.num_drafts > drafts
            if run >= 2 and verified == (phase == "verify"):  # past the warm-up runs
                timings[phase].append(time.perf_counter() - start)
    verify, decode = sorted(timings["verify"]), sorted(timings["decode"])
    if not verify or not decode:
        return {"error": f"{len(verify)} verify and {len(decode)} decode steps timed"}
    verify_ms, decode_ms = 1000 * verify[len(verify) // 2], 1000 * decode[len(decode) // 2]
    return {
        "verify_step_ms": round(verify_ms, 3),
        "decode_step_ms": round(decode_ms, 3),
        "verify_over_decode": round(verify_ms / decode_ms, 3),
        "steps_timed": [len(verify), len(decode)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["all", "one"])
    parser.add_argument("--figure", choices=FIGURES)
    parser.add_argument("--model", default="qwen3.6-27b")
    parser.add_argument("--work", default="/tmp/hybrid_spec_bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--figure-timeout-s", type=float, default=420)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.mode == "one":
        print("RESULT " + json.dumps(globals()[args.figure](work, args.model)), flush=True)
        return
    figures: dict = {}
    for figure in FIGURES:
        figure_args = ["one", "--figure", figure, "--work", str(work), "--model", args.model]
        figures[figure] = run_figure_process(__file__, figure_args, args.figure_timeout_s)
        print(figure, json.dumps(figures[figure]), flush=True)
    save(f"hybrid_spec_{args.model}", figures, args.out)


if __name__ == "__main__":
    main()
