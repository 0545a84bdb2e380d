"""Time from process start to the first token of `LLM(...)` on the Llama-3.1-8B shape (dummy weights),
and the KV cache capacity at gpu_memory_utilization 0.9, max_model_len 4096.

vLLM 0.26.0: 95 s to the first token; 444,528 KV tokens.
  python benchmarks/gpu/startup8b.py
"""

from __future__ import annotations

import argparse
import time

from common import MODELS, PROCESS_START, TOKENIZER, save  # noqa: I001

from fitserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    constructed_at = time.perf_counter()
    llm = LLM(
        str(MODELS / "llama-3.1-8b"),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=4096,
        gpu_memory_utilization=0.9,
    )
    engine_ready = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1), use_tqdm=False)
    first_token = time.perf_counter()
    stats = llm.engine.get_stats()
    kv_tokens = (stats.num_kv_blocks - 1) * stats.block_size
    save(
        "startup8b",
        {
            "process_start_to_first_token_s": round(first_token - PROCESS_START, 2),
            "imports_s": round(constructed_at - PROCESS_START, 2),
            "llm_constructor_s": round(engine_ready - constructed_at, 2),
            "kv_cache_tokens": kv_tokens,
            "kv_cache_gib": round(
                stats.num_kv_blocks * llm.engine.executor.runner.kv_bytes_per_block() / (1 << 30), 2
            ),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
