"""A hybrid model's second chat turn on the CPU: time to first token when it resumes from the first turn's
prefix (KV blocks plus the recurrent state snapshotted at a block boundary, --mamba-cache-mode align,
block size 16) against the same prompt computed cold.

The model: a small random Qwen3.5 (transformers' Qwen3_5ForCausalLM config: hidden 256, 8 layers, 6 Gated
DeltaNet and 2 full attention, float32), saved to a temporary folder with the SmolLM2 tokenizer. Each
repeat takes a fresh random conversation: turn 1 is a PREFIX-token prompt with TURN1_OUT generated tokens;
turn 2 is turn 1's prompt and output plus NEXT_USER new tokens, asked for one token (so generate's wall
time is the time to first token). Measured, median of REPEATS:
  - cold_ttft_ms: turn 2's prompt on an engine that never saw it (prefix caching on: no hit to take);
  - cold_no_prefix_caching_ttft_ms: the same with --no-enable-prefix-caching (no aligned chunking);
  - second_turn_ttft_ms: turn 2 right after turn 1 on the same engine, with its hit (tokens recorded).
Times are wall time (time.perf_counter); the load average at the start is recorded.

Usage: python benchmarks/cpu/hybrid_prefix_cache.py [--prefix 2048] [--repeats 5]
          [--out benchmarks/results/cpu_hybrid_prefix_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fitserve import LLM, SamplingParams  # noqa: E402
from tests.paths import SMOLLM2_TOKENIZER_DIR  # noqa: E402

TURN1_OUT = 16
NEXT_USER = 32
LIN, FULL = "linear_attention", "full_attention"


def save_model(folder: Path, max_len: int) -> None:
    config = transformers.Qwen3_5TextConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        layer_types=[LIN, LIN, LIN, FULL, LIN, LIN, LIN, FULL],
        max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM._from_config(config).to(torch.float32)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2_TOKENIZER_DIR / name, folder / name)


def timed(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return (time.perf_counter() - started) * 1000, list(out.outputs[0].token_ids), out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/cpu_hybrid_prefix_cache.json")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    max_len = args.prefix + TURN1_OUT + NEXT_USER + 64
    folder = Path(tempfile.mkdtemp(prefix="fitserve-hybrid-bench-"))
    try:
        save_model(folder, max_len)
        common = dict(dtype="float32", max_model_len=max_len, max_num_seqs=2, max_num_batched_tokens=max_len)
        warm_llm = LLM(str(folder), **common)
        cold_llm = LLM(str(folder), **common)
        off_llm = LLM(str(folder), enable_prefix_caching=False, **common)
        generator = torch.Generator().manual_seed(1)
        timed(cold_llm, torch.randint(0, 4096, (256,), generator=generator).tolist(), 1)  # warm-up
        timed(off_llm, torch.randint(0, 4096, (256,), generator=generator).tolist(), 1)
        cold, off, warm, hits, same = [], [], [], [], True
        for _ in range(args.repeats):
            first = torch.randint(0, 4096, (args.prefix,), generator=generator).tolist()
            _, out1, _ = timed(warm_llm, first, TURN1_OUT)
            second = first + out1 + torch.randint(0, 4096, (NEXT_USER,), generator=generator).tolist()
            warm_ms, warm_tok, hit = timed(warm_llm, second, 1)
            cold_ms, cold_tok, cold_hit = timed(cold_llm, second, 1)
            off_ms, off_tok, _ = timed(off_llm, second, 1)
            assert cold_hit == 0
            warm.append(warm_ms)
            cold.append(cold_ms)
            off.append(off_ms)
            hits.append(hit)
            same = same and warm_tok == cold_tok == off_tok
        result = {
            "benchmark": "hybrid_prefix_cache",
            "command": "python benchmarks/cpu/hybrid_prefix_cache.py"
            + "".join(f" {a}" for a in sys.argv[1:]),
            "machine": {
                "cpu": platform.machine(),
                "cores": os.cpu_count(),
                "load_average_1min_at_start": round(load, 2),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": version("transformers"),
            },
            "model": "random Qwen3_5ForCausalLM: hidden 256, 8 layers (6 Gated DeltaNet, 2 full attention), "
            "float32",
            "block_size": 16,
            "mamba_cache_mode": "align",
            "turn1_prompt_tokens": args.prefix,
            "turn1_output_tokens": TURN1_OUT,
            "turn2_prompt_tokens": args.prefix + TURN1_OUT + NEXT_USER,
            "turn2_hit_tokens": hits,
            "repeats": args.repeats,
            "cold_ttft_ms": round(statistics.median(cold), 1),
            "cold_no_prefix_caching_ttft_ms": round(statistics.median(off), 1),
            "second_turn_ttft_ms": round(statistics.median(warm), 1),
            "second_turn_over_cold": round(statistics.median(warm) / statistics.median(cold), 3),
            "first_token_same_as_cold": same,
            "all_ms": {"cold": cold, "cold_no_prefix_caching": off, "second_turn": warm},
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "all_ms"}, indent=2))


if __name__ == "__main__":
    main()
