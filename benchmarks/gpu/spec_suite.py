"""Issue 31's speed figures for speculative decoding, on one GPU.

  python benchmarks/gpu/spec_suite.py all [--out FILE]        # every figure, each engine in its own process
  python benchmarks/gpu/spec_suite.py one --figure NAME --work DIR

Figures (Llama-3.1-8B shape, dummy weights, greedy, ignore_eos):
- baseline8b: no speculation. Batch 1: 3 requests of 128 random prompt tokens and 256 output tokens, one
  at a time after a warm-up, output tok/s of the fastest; concurrency 32: 32 requests of 512 prompt tokens
  and 256 output tokens at once, the mean TPOT ((last token time - first token time) / 255) over them.
  Its outputs are the oracle's answers.
- oracle8b: `{"method": "oracle", "num_speculative_tokens": 3}`, drafting the baseline's own tokens (all
  accepted): the same batch-1 figure (`oracle_k3_single8b_tok_per_s`); then concurrency 32 with every
  draft wrong (`zero_accept_c32_tpot_ms`: speculation's cost when nothing is accepted, with its back-off).
  (Every draft right at concurrency 32 cannot be set up with dummy weights: bf16 sums over batch x 4 rows
  round differently from batch rows, the random model's near-ties flip, and the answers stop being its.)
- ngram_smollm2: the default model (SmolLM2-135M-Instruct, real weights) on 50 prompts that ask to rewrite
  or correct a text (benchmarks/data/rewrite_prompts.py), chat template, greedy, up to 160 tokens, one
  at a time: seconds for all 50 without speculation and with `{"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`, outputs compared, mean
  acceptance length.
- draft8b: `{"method": "draft_model", "model": <Llama-3.2-1B shape>, "num_speculative_tokens": 3}` beside
  the Llama-3.1-8B target, both dummy weights (acceptance meaningless): what a draft costs against a
  target step. `draft_k3_ms_batch{1,8}`: one whole draft of k = 3 tokens (the catch-up row and 2 decode
  steps, eager) for 1 and 8 requests of 128 tokens; `target_step_ms_batch1`: a plain batch-1 decode step
  of the same engine (speculation switched off, graphs on), from 256 tokens; the ratio of the two.
- eagle3_8b: `{"method": "eagle3", "model": <an EAGLE-3 head for Llama-3.1-8B>, "num_speculative_tokens":
  3}`, the head's config.json written here (the released format's shape: one layer, 32,000 draft ids),
  both dummy weights: `eagle3_k3_ms_batch{1,8}`, one whole draft (catch-up row and 2 recurrent steps,
  eager) for 1 and 8 requests of 128 tokens; `target_step_ms_batch1` of the same engine, whose target
  also copies three layers' hidden states each step (compare with draft8b's, which does not); the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from common import MODELS, TOKENIZER, greedy_params, machine, random_prompts, run_figure_process, save  # noqa: I001

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))

FIGURES = ("baseline8b", "oracle8b", "ngram_smollm2", "draft8b", "eagle3_8b")
# Llama-3.2-1B's shape over Llama-3.1-8B's config.json (the same vocabulary, RoPE and context)
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
}
K = 3
NGRAM_K = 4


def _llama(**kwargs):
    from fitserve import LLM

    return LLM(
        str(MODELS / "llama-3.1-8b"),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=2048,
        gpu_memory_utilization=0.9,
        **kwargs,
    )


def _batch1(llm, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    """Seconds per request (the first, a warm-up, not counted) and every request's tokens."""
    times, outputs = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], greedy_params(256), use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        outputs.append(list(out.outputs[0].token_ids))
    return times[1:], outputs


def _concurrent(llm, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(256), use_tqdm=False)
    tpots = []
    for out in outs:
        m = out.metrics
        tpots.append((m.last_token_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1))
    return 1000 * sum(tpots) / len(tpots), [list(o.outputs[0].token_ids) for o in outs]


def _workload() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    return random_prompts(rng, 4, 128), random_prompts(rng, 32, 512)


def baseline8b(work: Path) -> dict:
    single, c32 = _workload()
    llm = _llama()
    times, single_out = _batch1(llm, single)
    llm.generate([{"prompt_token_ids": c32[0][:64]}], greedy_params(8), use_tqdm=False)  # warm
    tpot, c32_out = _concurrent(llm, c32)
    (work / "answers.json").write_text(json.dumps({"single": single_out, "c32": c32_out}))
    return {
        "single8b_tok_per_s": round(256 / min(times), 1),
        "seconds_per_request": [round(t, 3) for t in times],
        "baseline_c32_tpot_ms": round(tpot, 2),
    }


def oracle8b(work: Path) -> dict:
    single, c32 = _workload()
    answers = json.loads((work / "answers.json").read_text())
    llm = _llama(speculative_config={"method": "oracle", "num_speculative_tokens": K})
    proposer = llm.engine.speculator.proposer
    vocab = llm.engine.config.model.vocab_size
    proposer.load(single, answers["single"], vocab)
    times, single_out = _batch1(llm, single)
    result = {
        "oracle_k3_single8b_tok_per_s": round(256 / min(times), 1),
        "seconds_per_request": [round(t, 3) for t in times],
        "single_outputs_equal_baseline": single_out == answers["single"],
    }
    stats = llm.engine.speculator.stats
    result["single_mean_acceptance_length"] = round(
        1 + stats.num_accepted_tokens / max(stats.num_drafts, 1), 3
    )
    proposer.load(c32, answers["c32"], vocab, miss=True)
    before = stats.snapshot()
    tpot, _ = _concurrent(llm, c32)
    result["zero_accept_c32_tpot_ms"] = round(tpot, 2)
    result["zero_accept_c32_drafted_tokens"] = stats.num_draft_tokens - before.num_draft_tokens
    result["zero_accept_c32_accepted_tokens"] = stats.num_accepted_tokens - before.num_accepted_tokens
    return result


def ngram_smollm2(work: Path) -> dict:
    from rewrite_prompts import rewrite_prompts

    from fitserve import LLM

    prompts = [[{"role": "user", "content": text}] for text in rewrite_prompts()]
    result: dict = {"prompts": len(prompts), "num_speculative_tokens": NGRAM_K}
    outputs = {}
    for name, config in (
        ("plain", None),
        (
            "ngram",
            {
                "method": "ngram",
                "num_speculative_tokens": NGRAM_K,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            },
        ),
    ):
        llm = LLM(speculative_config=config, max_model_len=2048)
        from fitserve import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=160)
        llm.chat(prompts[:2], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = [llm.chat([p], params, use_tqdm=False)[0] for p in prompts]
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        outputs[name] = [list(o.outputs[0].token_ids) for o in outs]
        result[f"{name}_seconds"] = round(elapsed, 2)
        result[f"{name}_output_tokens"] = tokens
        result[f"{name}_tok_per_s"] = round(tokens / elapsed, 1)
        if config is not None:
            stats = llm.engine.speculator.stats
            result["mean_acceptance_length"] = round(
                1 + stats.num_accepted_tokens / max(stats.num_drafts, 1), 3
            )
            result["draft_acceptance_rate"] = round(
                stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 3
            )
            result["drafted_steps"] = stats.num_drafts
        llm.engine.shutdown()
        del llm
    result["outputs_equal"] = outputs["plain"] == outputs["ngram"]
    result["ngram_smollm2_speedup"] = round(result["plain_seconds"] / result["ngram_seconds"], 3)
    result["sample_output"] = outputs["ngram"][0][:40]
    return result


def draft8b(work: Path) -> dict:
    folder = work / "llama-3.2-1b-shape"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **LLAMA_1B}))
    llm = _llama(
        speculative_config={"method": "draft_model", "model": str(folder), "num_speculative_tokens": K}
    )
    return _draft_cost(llm, "draft")


def eagle3_8b(work: Path) -> dict:
    folder = work / "eagle3-llama-3.1-8b-shape"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
    head = {**config, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}
    head.update(draft_vocab_size=32000, tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(head))
    llm = _llama(speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    return _draft_cost(llm, "eagle3")


def _draft_cost(llm, name: str) -> dict:
    """One whole draft's time (batch 1 and 8) against a batch-1 target step of the same engine."""
    import torch

    from fitserve.core.request import Request
    from fitserve.core.sampling_params import SamplingParams

    engine = llm.engine
    draft, speculator = engine.speculator.draft, engine.speculator
    rng = random.Random(0)
    result: dict = {
        "num_speculative_tokens": K,
        "draft_weights_gib": round(draft.weight_bytes / (1 << 30), 3),
    }
    for batch in (1, 8):
        requests = [
            Request(f"d{batch}-{i}", f"d{batch}-{i}", 0, p, SamplingParams(max_tokens=256), frozenset())
            for i, p in enumerate(random_prompts(rng, batch, 128))
        ]
        ids = {r.request_id for r in requests}
        draft.propose(requests, ids)  # the prompts' catch-up; each later draft recomputes the last token
        times = []
        for _ in range(30):
            torch.cuda.synchronize()
            start = time.perf_counter()
            drafts = draft.propose(requests, ids)  # ends with the drafts on the host
            times.append(time.perf_counter() - start)
        assert all(len(d) == K for d in drafts)
        result[f"{name}_k{K}_ms_batch{batch}"] = round(1000 * sorted(times)[len(times) // 2], 3)
        draft.propose([], set())  # gives their blocks back
    # the target alone: speculation off for this engine, graphs on
    engine.speculator = None
    prompt = random_prompts(rng, 1, 128)[0]
    llm.generate([{"prompt_token_ids": prompt}], greedy_params(16), use_tqdm=False)  # warm
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], greedy_params(256), use_tqdm=False)
    step_ms = 1000 * (time.perf_counter() - start) / 256
    engine.speculator = speculator
    result["target_step_ms_batch1"] = round(step_ms, 3)
    result[f"{name}_k3_over_target_step_batch1"] = round(result[f"{name}_k{K}_ms_batch1"] / step_ms, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["all", "one"])
    parser.add_argument("--figure", choices=FIGURES)
    parser.add_argument("--figures", default=",".join(FIGURES))
    parser.add_argument("--work", default="/tmp/spec_suite")
    parser.add_argument("--out", default=None)
    parser.add_argument("--figure-timeout-s", type=float, default=300)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.mode == "one":
        result = globals()[args.figure](work)
        print("RESULT " + json.dumps(result), flush=True)
        return
    figures: dict = {}
    for figure in args.figures.split(","):
        figure_args = ["one", "--figure", figure, "--work", str(work)]
        figures[figure] = run_figure_process(__file__, figure_args, args.figure_timeout_s)
        print(figure, json.dumps(figures[figure]), flush=True)
    base, oracle = figures.get("baseline8b", {}), figures.get("oracle8b", {})
    if "single8b_tok_per_s" in base and "oracle_k3_single8b_tok_per_s" in oracle:
        figures["oracle_k3_single8b_speedup"] = round(
            oracle["oracle_k3_single8b_tok_per_s"] / base["single8b_tok_per_s"], 3
        )
        figures["zero_accept_c32_tpot_ratio"] = round(
            oracle["zero_accept_c32_tpot_ms"] / base["baseline_c32_tpot_ms"], 3
        )
    out = args.out or str(Path(__file__).resolve().parents[1] / "results" / "h100_spec.json")
    save("spec_suite", {"machine_detail": machine(), **figures}, out)


if __name__ == "__main__":
    main()
