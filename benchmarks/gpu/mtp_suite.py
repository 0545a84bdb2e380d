"""MTP speculation's cost on the field report's model (issues 31, 32), on one GPU.

  python benchmarks/gpu/mtp_suite.py all [--out FILE]        # every figure, each engine in its own process
  python benchmarks/gpu/mtp_suite.py one --figure NAME --work DIR

Figures (Qwen3.6-27B-AWQ-INT4's shape from shared/models, dummy weights: acceptance is meaningless, so
these are costs; greedy, ignore_eos):
- mtp_k3_27b_awq, mtp_k4_27b_awq: `{"method": "mtp", "num_speculative_tokens": k}`. `mtp_k{k}_ms_batch{1,8}`:
  one whole draft (the catch-up row and k - 1 recurrent steps of the MTP layer, eager) for 1 and 8
  requests of 128 tokens; `target_step_ms_batch1`: a plain batch-1 decode step of the same engine
  (speculation switched off, graphs on), from 256 tokens; their ratio. With acceptance a per step
  (accepted drafts), a speculative step yields 1 + a tokens for (1 + ratio + the verify's extra rows)
  target steps: the break-even acceptance is about the ratio.
- plain_27b_awq: no speculation, batch-1 output tok/s (3 requests of 128 prompt tokens, 256 out, one at a
  time after a warm-up, the fastest), and the same with MTP k = 3 on (drafts never accepted: what the
  back-off leaves of the cost), `mtp_k3_zero_accept_tok_per_s`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from common import MODELS, TOKENIZER, greedy_params, random_prompts, run_figure_process, save  # noqa: I001

FIGURES = ("mtp_k3_27b_awq", "mtp_k4_27b_awq", "plain_27b_awq")


def _qwen36(**kwargs):
    from fitserve import LLM

    return LLM(
        str(MODELS / "qwen3.6-27b-awq-int4"),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        **kwargs,
    )


def _draft_cost(llm, k: int) -> dict:
    """One whole draft's time (batch 1 and 8) against a batch-1 target step of the same engine."""
    import torch

    from fitserve.core.request import Request
    from fitserve.core.sampling_params import SamplingParams

    engine = llm.engine
    speculator = engine.speculator
    draft = speculator.draft
    rng = random.Random(0)
    result: dict = {"num_speculative_tokens": k, "mtp_weights_gib": round(draft.weight_bytes / (1 << 30), 3)}
    for batch in (1, 8):
        requests = [
            Request(f"d{batch}-{i}", f"d{batch}-{i}", 0, p, SamplingParams(max_tokens=256), frozenset())
            for i, p in enumerate(random_prompts(rng, batch, 128))
        ]
        ids = {r.request_id for r in requests}
        draft.propose(requests, ids)  # the prompts' catch-up (zeros for rows the target never computed)
        times = []
        for _ in range(30):
            torch.cuda.synchronize()
            start = time.perf_counter()
            drafts = draft.propose(requests, ids)  # ends with the drafts on the host
            times.append(time.perf_counter() - start)
        assert all(len(d) == k for d in drafts)
        result[f"mtp_k{k}_ms_batch{batch}"] = round(1000 * sorted(times)[len(times) // 2], 3)
        draft.propose([], set())  # gives their blocks back
    engine.speculator = None  # the target alone, graphs on
    prompt = random_prompts(rng, 1, 128)[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy_params(16), use_tqdm=False)  # warm
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], greedy_params(256), use_tqdm=False)
    step_ms = 1000 * (time.perf_counter() - start) / 256
    engine.speculator = speculator
    result["target_step_ms_batch1"] = round(step_ms, 3)
    result[f"mtp_k{k}_over_target_step_batch1"] = round(result[f"mtp_k{k}_ms_batch1"] / step_ms, 3)
    return result


def mtp_k3_27b_awq(work: Path) -> dict:
    return _draft_cost(_qwen36(speculative_config={"method": "mtp", "num_speculative_tokens": 3}), 3)


def mtp_k4_27b_awq(work: Path) -> dict:
    return _draft_cost(_qwen36(speculative_config={"method": "mtp", "num_speculative_tokens": 4}), 4)


def _batch1_tok_per_s(llm) -> float:
    rng = random.Random(1)
    prompts = random_prompts(rng, 4, 128)
    llm.generate([{"prompt_token_ids": prompts[0]}], greedy_params(32), use_tqdm=False)  # warm
    best = 0.0
    for prompt in prompts[1:]:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], greedy_params(256), use_tqdm=False)
        best = max(best, 256 / (time.perf_counter() - start))
    return round(best, 2)


def plain_27b_awq(work: Path) -> dict:
    llm = _qwen36()
    result = {"plain_tok_per_s": _batch1_tok_per_s(llm)}
    llm.engine.shutdown()
    del llm
    import torch

    torch.cuda.empty_cache()
    llm = _qwen36(speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    result["mtp_k3_zero_accept_tok_per_s"] = _batch1_tok_per_s(llm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["all", "one"])
    parser.add_argument("--figure", choices=FIGURES)
    parser.add_argument("--figures", default=",".join(FIGURES))
    parser.add_argument("--work", default="/tmp/mtp_suite")
    parser.add_argument("--out", default=None)
    parser.add_argument("--figure-timeout-s", type=float, default=400)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.mode == "one":
        print("RESULT " + json.dumps(globals()[args.figure](work)), flush=True)
        return
    figures: dict = {}
    for figure in args.figures.split(","):
        figure_args = ["one", "--figure", figure, "--work", str(work)]
        figures[figure] = run_figure_process(__file__, figure_args, args.figure_timeout_s)
        print(figure, json.dumps(figures[figure]), flush=True)
    save("mtp_suite", figures, args.out)


if __name__ == "__main__":
    main()
