"""CPU cost of incremental detokenization per token: the token byte table (fast path) against the
window path (two `tokenizer.decode` calls on a short window per token), on the SmolLM2 tokenizer.

Engine-shaped workload: 256 sequences, each fed one token per step (`add_tokens([id])`, then
`stream_text(False)` as the output processor does), for 256 steps; with and without stop strings,
on English and on multilingual text. Also: the table's one-time build, cost growth over one
8192-token output, and `decode_token` (logprob entries). Every fast-path text is checked against
`tokenizer.decode`. Times are CPU time of this process (time.process_time), so other load on the
machine inflates them less than wall time would.

Usage: python benchmarks/detokenizer_speed.py [--out benchmarks/results/detokenizer_cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from typing import Any

import transformers
from transformers import AutoTokenizer

from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.detokenizer import IncrementalDetokenizer, decode_token
from fitserve.token_bytes import token_byte_table

TOKENIZER = "/work/shared/tokenizers/smollm2"
NUM_SEQUENCES = 256  # tokens per engine step: one per running sequence
NUM_STEPS = 256
REPEATS = 3
STOP_STRINGS = ["\n\nUser:", "</answer>", "###"]  # never in the corpora, so nothing stops early
ENGLISH = (
    "The scheduler keeps a queue of waiting requests and a list of running ones. At every step it "
    "admits as many waiting requests as the free KV cache blocks allow, then asks the model runner "
    "for one forward pass over all of them: prompts are prefilled in chunks, and each running "
    "sequence decodes one token. When memory runs out, the newest request is preempted and its "
    "blocks go back to the pool; it is recomputed later from its prompt and the tokens it already "
    "produced. Answers look like this:\n\n"
    "```python\n"
    "def mean(values: list[float]) -> float:\n"
    "    # An empty list has no mean: say so instead of dividing by zero.\n"
    '    if not values:\n        raise ValueError("mean() of an empty list")\n'
    "    return sum(values) / len(values)\n"
    "```\n\n"
    "Costs: 12.5 ms per step at 256 sequences, 3.2 GiB of KV cache, 98% of blocks in use.\n"
)
MULTILINGUAL = (
    "你好，世界！今天天气很好，我们去公园散步吧。日本語のテキストも少し書きます。한국어 문장도 있습니다. "
    "Привет, мир! Как дела? مرحبا بالعالم، كيف حالك؟ नमस्ते दुनिया, आप कैसे हैं? Γειά σου κόσμε. "
    "Emoji: 🎉👍🏽👨‍👩‍👧‍👦🇯🇵 and math: ∀x∈ℝ, x²≥0. "
)


def corpus_ids(tokenizer: Any, text: str, min_tokens: int) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (min_tokens // len(ids) + 1))[:min_tokens]


def engine_steps(tokenizer: Any, ids: list[int], use_byte_table: bool, stop: list[str] | None) -> dict:
    """µs per token (CPU time of this process, best of REPEATS) for NUM_SEQUENCES sequences fed one
    token per step for NUM_STEPS steps."""
    params = SamplingParams(stop=stop)
    streams = [ids[37 * k : 37 * k + NUM_STEPS] for k in range(NUM_SEQUENCES)]
    best = float("inf")
    for _ in range(REPEATS):
        detoks = [
            IncrementalDetokenizer(tokenizer, ids[:32], params, use_byte_table=use_byte_table)
            for _ in streams
        ]
        assert all(d.uses_byte_table is use_byte_table for d in detoks)
        gc.collect()
        start = time.process_time()
        for step in range(NUM_STEPS):
            for detok, stream in zip(detoks, streams):
                detok.add_tokens([stream[step]])
                detok.stream_text(False)
        best = min(best, time.process_time() - start)
    for detok, stream in zip(detoks, streams):
        detok.finish()
        if use_byte_table:  # the fast path's text is decode's, exactly
            assert detok.output_text == tokenizer.decode(stream), "fast path differs from decode"
    us = best / (NUM_SEQUENCES * NUM_STEPS) * 1e6
    return {"us_per_token": round(us, 3), "ms_per_256_token_step": round(us * 256 / 1000, 3)}


def long_output(tokenizer: Any, ids: list[int], length: int = 8192, window: int = 1024) -> dict:
    """Fast path over one long output: µs per token over the first and the last `window` tokens."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=STOP_STRINGS))
    marks = []
    start = time.process_time()
    for index, token_id in enumerate(ids[:length]):
        if index in (window, length - window):
            marks.append(time.process_time())
        detok.add_tokens([token_id])
        detok.stream_text(False)
    end = time.process_time()
    first, last = marks[0] - start, end - marks[1]
    return {
        "tokens": length,
        "chars": len(detok.output_text),
        "first_us_per_token": round(first / window * 1e6, 3),
        "last_us_per_token": round(last / window * 1e6, 3),
    }


def decode_token_cost(tokenizer: Any) -> dict:
    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(20000)]
    start = time.process_time()
    fast = [decode_token(tokenizer, i) for i in ids]
    middle = time.process_time()
    reference = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    end = time.process_time()
    assert fast == reference, "decode_token differs from tokenizer.decode"
    per_call = {
        "fast_path": (middle - start) / len(ids) * 1e6,
        "tokenizer_decode": (end - middle) / len(ids) * 1e6,
    }
    return {"us_per_call": {k: round(v, 3) for k, v in per_call.items()}, "calls": len(ids)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/detokenizer_cpu.json")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    start = time.perf_counter()
    assert token_byte_table(tokenizer) is not None
    build_ms = (time.perf_counter() - start) * 1000

    needed = 37 * NUM_SEQUENCES + NUM_STEPS
    corpora = {
        "english": corpus_ids(tokenizer, ENGLISH, needed),
        "multilingual": corpus_ids(tokenizer, MULTILINGUAL, needed),
    }
    workloads: dict[str, dict] = {}
    for corpus, ids in corpora.items():
        for stop in (None, STOP_STRINGS):
            key = f"{corpus}, {'stop strings' if stop else 'no stop strings'}"
            fast = engine_steps(tokenizer, ids, True, stop)
            window = engine_steps(tokenizer, ids, False, stop)
            speedup = round(window["us_per_token"] / fast["us_per_token"], 1)
            workloads[key] = {"fast_path": fast, "window_path": window, "speedup": speedup}
            print(
                f"{key:32s} µs/token: fast {fast['us_per_token']:6.2f}, window {window['us_per_token']:6.2f}"
            )
    result = {
        "benchmark": "detokenizer_speed",
        "command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "transformers": transformers.__version__,
        },
        "tokenizer": TOKENIZER,
        "shape": {"sequences": NUM_SEQUENCES, "steps": NUM_STEPS, "stop_strings": STOP_STRINGS},
        "table_build_ms": round(build_ms, 1),
        "workloads": workloads,
        "long_output_fast_path": long_output(tokenizer, corpus_ids(tokenizer, ENGLISH, 8192)),
        "decode_token": decode_token_cost(tokenizer),
    }
    print(json.dumps(result, indent=2, ensure_ascii=False))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, ensure_ascii=False)


if __name__ == "__main__":
    main()
