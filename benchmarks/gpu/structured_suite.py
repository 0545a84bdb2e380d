"""Issue 33's speed figures for structured outputs, on one GPU: the cost of constraining decoding.

  python benchmarks/gpu/structured_suite.py [--out FILE]

Llama-3.1-8B shape, dummy weights, one engine: 32 requests at once of 512 random prompt tokens and up to 256
output tokens, greedy, first unconstrained (ignore_eos), then each constrained by the 10-field JSON schema
of benchmarks/cpu/structured_backends.py; the mean TPOT ((last token time - first token time) / (tokens - 1))
of each (`plain_c32_tpot_ms`, `structured_json_c32_tpot_ms`). Then the schema's compile time in this
engine's grammar backend, cold (a variant never seen) and cached.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

from common import MODELS, TOKENIZER, machine, save  # noqa: I001

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from structured_backends import SCHEMA  # noqa: E402


def _tpot_ms(outputs) -> tuple[float, int]:
    tpots, tokens = [], 0
    for out in outputs:
        n = len(out.outputs[0].token_ids)
        tokens += n
        if n > 1:
            tpots.append((out.metrics.last_token_time - out.metrics.first_token_time) / (n - 1))
    return 1000 * sum(tpots) / len(tpots), tokens


def workload(steps: int = 256):
    """(llm, prompts, plain params, constrained params): the engine over the Llama-3.1-8B shape, 32 prompts
    of 512 random tokens, greedy for `steps` tokens unconstrained or under SCHEMA; warmed once."""
    from fitserve import LLM, SamplingParams
    from fitserve.core.sampling_params import StructuredOutputsParams

    llm = LLM(
        str(MODELS / "llama-3.1-8b"),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=2048,
        gpu_memory_utilization=0.9,
    )
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randint(0, 30000) for _ in range(512)]} for _ in range(32)]
    plain = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0, max_tokens=steps, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    llm.generate(prompts[:4], constrained, use_tqdm=False)  # warm: graphs, the schema compiled once
    llm.generate(prompts[:4], plain, use_tqdm=False)
    return llm, prompts, plain, constrained


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from fitserve.core.sampling_params import StructuredOutputsParams

    llm, prompts, plain, constrained = workload()
    result: dict = {}
    for name, params in (("plain", plain), ("structured_json", constrained), ("plain_again", plain)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tpot, tokens = _tpot_ms(outputs)
        result[f"{name}_c32_tpot_ms"] = round(tpot, 3)
        result[f"{name}_c32_output_tokens"] = tokens
        result[f"{name}_c32_seconds"] = round(time.perf_counter() - start, 2)
        if name == "structured_json":
            result["structured_finish_reasons"] = sorted({o.outputs[0].finish_reason for o in outputs})
    base = (result["plain_c32_tpot_ms"] + result["plain_again_c32_tpot_ms"]) / 2
    result["structured_overhead"] = round(result["structured_json_c32_tpot_ms"] / base - 1, 4)
    variant = copy.deepcopy(SCHEMA)
    variant["properties"]["extra"] = {"type": "integer"}
    manager = llm.engine.structured
    for name in ("cold", "cached"):
        start = time.perf_counter()
        manager.compile_now(StructuredOutputsParams(json=variant))
        result[f"compile_{name}_ms"] = round(1000 * (time.perf_counter() - start), 3)
    print(result, flush=True)
    out = args.out or str(Path(__file__).resolve().parents[1] / "results" / "h100_structured.json")
    save("structured_suite", {"machine_detail": machine(), **result}, out)


if __name__ == "__main__":
    main()
