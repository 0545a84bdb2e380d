"""How long an echoed 8,000-token prompt with `logprobs: 20` holds the engine thread, before and after
prompt-logprob tokens were moved off it.

Each prompt position carries 21 entries (the prompt token plus the top 20): 168,000 for 8,000 positions.
The engine thread turns the sampler's entries into `{token id: Logprob}` per position
(`OutputProcessor.add_prompt_logprobs`); every other stream waits while it does.

- before: each entry decoded on the engine thread, one `decode_token` per entry (the former code); on a
  tokenizer with the token byte table (SmolLM2) and without one (each entry a `tokenizer.decode` call,
  the fallback path, measured on fewer positions and scaled).
- after: the server's engine keeps the sampler's entries as they are (`decode_logprob_tokens = False`:
  a list extend, and a `LazyPromptLogprobs` view per output); the request handler then builds the
  positions and the completions `logprobs` object (`completion_logprobs`), decoding each distinct token
  id once, outside the engine thread. The offline engine (`LLM`) still builds and decodes on its thread,
  each distinct id once per engine (`after_offline_engine_thread`).

Synthetic entries (the top 20 are random vocabulary ids), the SmolLM2 tokenizer; wall time, best of
--repeats.

Usage: python benchmarks/prompt_logprobs.py [--out benchmarks/results/cpu_prompt_logprobs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from transformers import AutoTokenizer

from fitserve.core.outputs import Logprob, PositionLogprobs, TokenLogprobs
from fitserve.engine.detokenizer import decode_token
from fitserve.engine.output_processor import LazyPromptLogprobs, OutputProcessor
from fitserve.server.logprobs import completion_logprobs

TOKENIZER = "/work/shared/tokenizers/smollm2"


def make_entries(vocab: int, positions: int, top: int, seed: int) -> tuple[list[int], list[TokenLogprobs]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(positions + 1)]
    entries = []
    for token_id in prompt[1:]:
        ids = [token_id, *(rng.randrange(vocab) for _ in range(top))]
        logprobs = [-rng.random() * 10 for _ in ids]
        entries.append(TokenLogprobs(token_ids=ids, logprobs=logprobs, ranks=list(range(1, len(ids) + 1))))
    return prompt, entries


def before(tokenizer: Any, entries: list[TokenLogprobs], decode: Callable[[Any, int], str]) -> list:
    """The former OutputProcessor._position_logprobs: one decode per entry, on the engine thread."""
    result: list[PositionLogprobs | None] = [None]
    for entry in entries:
        position: PositionLogprobs = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in position:
                position[token_id] = Logprob(logprob, rank, decode(tokenizer, token_id))
        result.append(position)
    return result


def engine_thread(tokenizer: Any, entries: list[TokenLogprobs], decode: bool) -> Any:
    """What the engine thread does with a prompt's entries: OutputProcessor.add_prompt_logprobs, then the
    request's final output (RequestOutput.prompt_logprobs)."""
    processor = OutputProcessor(tokenizer)
    processor.decode_logprob_tokens = decode
    if decode:
        return [None, *(processor._position_logprobs(entry) for entry in entries)]
    kept: list[TokenLogprobs | None] = [None]
    kept.extend(entries)
    return LazyPromptLogprobs(list(kept))


def best_s(call: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--positions", type=int, default=8000)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--no-table-positions", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    prompt, entries = make_entries(len(tokenizer), args.positions, args.top, seed=0)

    def no_table_decode(tok: Any, token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    no_table = entries[: args.no_table_positions]
    no_table_s = best_s(lambda: before(tokenizer, no_table, no_table_decode), 1)
    figures = {
        "before_engine_thread_table_s": best_s(
            lambda: before(tokenizer, entries, decode_token), args.repeats
        ),
        "before_engine_thread_no_table_s": no_table_s * len(entries) / len(no_table),
        "after_engine_thread_s": best_s(lambda: engine_thread(tokenizer, entries, False), args.repeats),
        "after_offline_engine_thread_s": best_s(
            lambda: engine_thread(tokenizer, entries, True), args.repeats
        ),
        "after_handler_completion_logprobs_s": best_s(
            lambda: completion_logprobs(tokenizer, prompt, engine_thread(tokenizer, entries, False), 0),
            args.repeats,
        ),
    }
    result = {
        "workload": "prompt_logprobs",
        "command": "python " + " ".join(sys.argv),
        "positions": args.positions,
        "entries_per_position": args.top + 1,
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
        },
        "figures": {name: round(value, 4) for name, value in figures.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
