"""Grammar backends for structured outputs on the CPU: xgrammar against llguidance, on the SmolLM2
tokenizer (vocabulary 49,152).

Measured for each backend, on one 10-field JSON schema (strings, integers, numbers, booleans, an enum,
an array, a nested object; every field required, additionalProperties false):
  - tokenizer setup: building the backend's tokenizer view (once per engine);
  - compile_cold_ms: the schema to a compiled grammar with an empty cache (a fresh compiler), the
    median of REPEATS runs; compile_cached_ms: the same schema again on the same compiler;
  - first_mask_ms: the first mask after compiling (llguidance builds its lexer lazily, so part of its
    compile lands here);
  - fill_us_per_token: the mask fill for one sequence, per token, while the tokens of a valid
    instance of the schema are fed one by one (median and p99 over every token of REPEATS passes);
  - accept_us_per_token: advancing the matcher by one token.
Then fitserve's own path (xgrammar): the sampler's mask for a batch (every row's matcher fills the
host bitmask, fitserve/structured/bitmask.py unpacks it and masks the logits), for 1 and 32
constrained rows of the SmolLM2 vocabulary and of Llama-3's (128,256), against the sampler's call with
the same rows unconstrained (greedy: the argmax alone).
Times are wall time (time.perf_counter); the machine's load average when the run started is recorded
(other work on a 2-core machine inflates the times).

Usage: python benchmarks/cpu/structured_backends.py [--tokenizer DIR]
          [--out benchmarks/results/cpu_structured_backends.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from typing import Any

import torch
from transformers import AutoTokenizer

REPEATS = 5
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "height_m": {"type": "number"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "city": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height_m", "email", "active", "role", "tags", "score", "city", "address"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "height_m": 1.65,
    "email": "ada@example.org",
    "active": True,
    "role": "admin",
    "tags": ["math", "engines", "poetry"],
    "score": 97.5,
    "city": "London",
    "address": {"street": "12 St James's Square", "zip": "SW1Y 4JH"},
}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _summary(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {
        "median": round(statistics.median(ordered) * 1e6, 2),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 2),
        "mean": round(statistics.fmean(ordered) * 1e6, 2),
    }


def bench_xgrammar(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    setup = time.perf_counter() - started
    schema = json.dumps(SCHEMA)
    cold, cached = [], []
    for _ in range(REPEATS):
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        compiler.compile_json_schema(schema, any_whitespace=False)
        cached.append(time.perf_counter() - started)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    fills, accepts, first = [], [], []
    for _ in range(REPEATS):
        matcher = xgr.GrammarMatcher(compiled)
        for position, token in enumerate(token_ids):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            elapsed = time.perf_counter() - started
            (first if position == 0 else fills).append(elapsed)
            started = time.perf_counter()
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token} at position {position}")
            accepts.append(time.perf_counter() - started)
    return {
        "tokenizer_setup_ms": _ms(setup),
        "compile_cold_ms": _ms(statistics.median(cold)),
        "compile_cached_ms": _ms(statistics.median(cached)),
        "first_mask_ms": _ms(statistics.median(first)),
        "fill_us_per_token": _summary(fills),
        "accept_us_per_token": _summary(accepts),
    }


def bench_llguidance(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - started
    cold, first = [], []
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    for _ in range(REPEATS):
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        cold.append(time.perf_counter() - started)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        first.append(time.perf_counter() - started)
    fills, accepts = [], []
    for _ in range(REPEATS):
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        started = time.perf_counter()
        matcher.consume_token(token_ids[0])
        accepts.append(time.perf_counter() - started)
        for position, token in enumerate(token_ids[1:], start=1):
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            fills.append(time.perf_counter() - started)
            started = time.perf_counter()
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token} at position {position}")
            accepts.append(time.perf_counter() - started)
    return {
        "tokenizer_setup_ms": _ms(setup),
        # llguidance has no compile cache of its own: a matcher is built from the grammar each time
        "compile_cold_ms": _ms(statistics.median(cold)),
        "compile_cached_ms": None,
        "first_mask_ms": _ms(statistics.median(first)),
        "fill_us_per_token": _summary(fills),
        "accept_us_per_token": _summary(accepts),
    }


def _median_s(call: Any) -> float:
    for _ in range(3):
        call()
    samples = []
    for _ in range(20):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def bench_sampler_mask(tokenizer: Any) -> dict[str, Any]:
    from fitserve.core.sampling_params import SamplingParams
    from fitserve.structured import StructuredOutputsParams
    from fitserve.structured.manager import StructuredOutputManager
    from fitserve.worker.logits_processors import apply_grammar_bitmasks
    from fitserve.worker.sampler import Sampler, SamplingRow

    greedy = SamplingParams(temperature=0)
    sampler = Sampler()
    result: dict[str, Any] = {}
    for width in (len(tokenizer), 128256):
        manager = StructuredOutputManager(tokenizer, width, frozenset({tokenizer.eos_token_id}))
        compiled = manager.compile_now(StructuredOutputsParams(json=SCHEMA))
        for rows in (1, 32):
            logits = torch.randn(rows, width)
            constrained = [
                SamplingRow(greedy, [1], [], grammar=manager.new_state(compiled)) for _ in range(rows)
            ]
            plain = [SamplingRow(greedy, [1], []) for _ in range(rows)]
            result[f"vocab_{width}_rows_{rows}"] = {
                "mask_only_ms": _ms(
                    _median_s(lambda x=logits, r=constrained: apply_grammar_bitmasks(x.clone(), r))
                ),
                "sampler_constrained_ms": _ms(_median_s(lambda x=logits, r=constrained: sampler(x, r))),
                "sampler_unconstrained_ms": _ms(_median_s(lambda x=logits, r=plain: sampler(x, r))),
            }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default="/work/shared/tokenizers/smollm2")
    parser.add_argument("--out", default="benchmarks/results/cpu_structured_backends.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    token_ids = tokenizer.encode(json.dumps(INSTANCE, separators=(", ", ": ")), add_special_tokens=False)
    result = {
        "benchmark": "structured_backends",
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "cpu": platform.machine(),
            "cores": os.cpu_count(),
            "load_average_1min_at_start": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "xgrammar": version("xgrammar"),
            "llguidance": version("llguidance"),
        },
        "tokenizer": "SmolLM2 (HuggingFaceTB/SmolLM2-135M-Instruct)",
        "vocab_size": vocab_size,
        "schema_fields": len(SCHEMA["properties"]),
        "instance_tokens": len(token_ids),
        "repeats": REPEATS,
        "xgrammar": bench_xgrammar(tokenizer, vocab_size, token_ids),
        "llguidance": bench_llguidance(tokenizer, vocab_size, token_ids),
        "fitserve_sampler_mask_cpu": bench_sampler_mask(tokenizer),
    }
    text = json.dumps(result, indent=2)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
