"""Qwen3.6 hybrids on one engine, fitserve or vLLM, with the same settings, for a same-lease ratio (issue 32's
"compared with vLLM 0.26 on the same machine kind").

For each model (shared/models/qwen3.6-27b, qwen3.6-35b-a3b; dummy weights, the SmolLM2 tokenizer,
max_model_len 4096, max_num_seqs 16, gpu_memory_utilization 0.9, CUDA graphs as each engine defaults):
- single: batch-1 decode, 128 random prompt tokens and 256 greedy output tokens, best of 3 after one
  warm-up request (as benchmarks/gpu/qwen36_suite.py's single figures), output tok/s;
- batch16: 16 requests of 512 random prompt tokens and 256 output tokens at once, output tok/s.
Also ready_s (constructor to ready). Each model runs in its own process (one engine's memory is gone
before the next starts). --text-only gives the engine the text model's config alone (text_config
flattened, Qwen3_5[Moe]ForCausalLM), for an engine that cannot take the multimodal checkpoint's form.

  python benchmarks/gpu/hybrid_vs_vllm.py --engine vllm|fitserve [--models 27b,35b] --out FILE
      [--stderr-dir DIR]
vLLM 0.26.0 from ../shared/vllm_bundle (PYTHONPATH with its site folder).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import MODELS, TOKENIZER, engine_classes, engine_generate, engine_single_request, save  # noqa: I001

SHAPES = {"27b": "qwen3.6-27b", "35b": "qwen3.6-35b-a3b"}
SETTINGS = {"load_format": "dummy", "max_model_len": 4096, "max_num_seqs": 16, "gpu_memory_utilization": 0.9}


def text_only_folder(model: str) -> str:
    """A folder whose config.json is the checkpoint's text model alone (text_config flattened, the
    ForCausalLM architecture): for an engine that cannot take the multimodal form."""
    config = json.loads((MODELS / SHAPES[model] / "config.json").read_text())
    text = dict(config["text_config"])
    family = "Qwen3_5Moe" if "num_experts" in text else "Qwen3_5"
    text["architectures"] = [f"{family}ForCausalLM"]
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    folder = Path(tempfile.mkdtemp(prefix=f"text_only_{model}_"))
    (folder / "config.json").write_text(json.dumps(text))
    return str(folder)


def run_one(engine: str, model: str, text_only: bool) -> dict:
    started = time.monotonic()
    LLM, SamplingParams = engine_classes(engine)
    folder = text_only_folder(model) if text_only else str(MODELS / SHAPES[model])
    llm = LLM(folder, tokenizer=str(TOKENIZER), **SETTINGS)
    figures: dict = {
        "model": SHAPES[model],
        "text_only": text_only,
        "ready_s": round(time.monotonic() - started, 1),
    }
    rng = random.Random(0)

    tok_per_s, times = engine_single_request(llm, SamplingParams, rng)
    figures["single_tok_per_s"] = round(tok_per_s, 1)
    figures["single_seconds"] = [round(t, 3) for t in times]
    batch = [[rng.randint(0, 10000) for _ in range(512)] for _ in range(16)]
    engine_generate(llm, SamplingParams, batch[:2], 8)  # warm-up of the prompt shapes
    seconds, tokens = engine_generate(llm, SamplingParams, batch, 256)
    figures["batch16_out_tok_per_s"] = round(tokens / seconds, 1)
    print("FIGURES " + json.dumps(figures), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["fitserve", "vllm"], required=True)
    parser.add_argument("--models", default="27b,35b")
    parser.add_argument("--one", choices=list(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--text-only", action="store_true", help="the text model's config alone (see above)")
    parser.add_argument("--out")
    parser.add_argument("--stderr-dir", help="where a failed run's whole stderr is written")
    args = parser.parse_args()
    if args.one:
        run_one(args.engine, args.one, args.text_only)
        return
    figures: dict = {"engine": args.engine, "settings": SETTINGS}
    if args.engine == "vllm":
        import vllm

        figures["vllm"] = vllm.__version__
    for model in args.models.split(","):
        command = [sys.executable, __file__, "--engine", args.engine, "--one", model]
        command += ["--text-only"] if args.text_only else []
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            figures[model] = {"error": f"over {args.timeout_s} s"}
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
        if lines:
            figures[model] = json.loads(lines[-1].removeprefix("FIGURES "))
        else:
            # the first error lines say why (vLLM's model inspection runs in a child whose log comes first);
            # the whole stderr goes to --stderr-dir (the inspection's own traceback may be anywhere in it)
            errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
            figures[model] = {"error": f"exit {done.returncode}", "first_errors": errors[:12]}
            figures[model]["traceback_lines"] = [
                line for line in done.stderr.splitlines() if line.startswith(("Traceback", "  File", "    "))
            ][-60:]
            if args.stderr_dir:
                where = Path(args.stderr_dir) / f"hybrid_vs_vllm_{args.engine}_{model}.stderr.txt"
                where.parent.mkdir(parents=True, exist_ok=True)
                where.write_text(done.stderr)
                figures[model]["stderr_file"] = str(where)
    save(f"hybrid_vs_vllm_{args.engine}", figures, args.out)


if __name__ == "__main__":
    main()
