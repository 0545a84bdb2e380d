"""Issue 27's figures for one engine, fitserve or vLLM, on the Llama-3.1-8B shape (dummy weights).

  serve:   `ENGINE serve MODEL --load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.9`, both
           engines otherwise at their serving defaults; one client (`python -m fitserve.bench serve`) sends
           random prompts of 256-1024 tokens (--random-input-len 640 --random-range-ratio 0.6) reading
           128-512 tokens back (--random-output-len 320; the same ratio), eos ignored, at concurrency 64,
           128 and 256, four waves each (num prompts = 4 x concurrency), after a warm-up of another seed.
           Keys: serve_c{64,128,256}_{out_tok_per_s,mean_tpot_ms,p99_ttft_ms}, kv_tokens_8b (from the
           server's log, with its KV GiB).
  offline: one `LLM` with max_model_len 40960, max_num_batched_tokens 8192, gpu_memory_utilization 0.9:
           prefill_heavy (384 requests: 192 of them one of four shared 2,048-token prefixes plus their own
           256-1,024 tokens, 192 their own 512-2,048 tokens; 32-256 output tokens; greedy, eos ignored:
           ~14 prompt tokens per output token) -> prefill_heavy_out_tok_per_s;
           one 32,768-token prompt, one output token (after another one as a warm-up) -> prefill_32k_ttft_ms;
           eight 8,192-token prompts, one output token each -> prefill_tok_per_s_8k_chunks.

  python benchmarks/gpu/load_suite.py serve --engine fitserve --out DIR [--step-trace FILE] [--server-arg=...]
  python benchmarks/gpu/load_suite.py offline --engine vllm --out DIR

vLLM 0.26.0 runs from ../shared/vllm_bundle (PYTHONPATH with its site folder); fitserve from this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from common import MODELS, TOKENIZER, VLLM_ENV, engine_classes, machine  # noqa: I001

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_serve_gpu import _server_env, stop, wait_until_ready  # noqa: E402

MODEL = MODELS / "llama-3.1-8b"
CONCURRENCIES = (64, 128, 256)
WAVES = 4
INPUT_MEAN, OUTPUT_MEAN, RANGE_RATIO = 640, 320, 0.6
KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
KV_GIB = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


def server_command(engine: str, model: str, port: int, extra: list[str]) -> list[str]:
    common = [model, "--load-format", "dummy", "--tokenizer", str(TOKENIZER), "--port", str(port),
              "--max-model-len", "4096", "--gpu-memory-utilization", "0.9", *extra]  # fmt: skip
    if engine == "fitserve":
        return [sys.executable, "-m", "fitserve", "serve", *common]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *common]


def client(base_url: str, flags: list[str], save_as: Path | None) -> dict | None:
    command = [sys.executable, "-m", "fitserve.bench", "serve", "--base-url", base_url, "--tokenizer",
               str(TOKENIZER), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--random-input-len", str(INPUT_MEAN),
               "--random-output-len", str(OUTPUT_MEAN), "--random-range-ratio", str(RANGE_RATIO),
               *flags]  # fmt: skip
    if save_as is not None:
        command += ["--save-result", "--save-detailed", "--result-dir", str(save_as.parent),
                    "--result-filename", save_as.name]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(command, cwd=REPO, check=True, env=env)
    return json.loads(save_as.read_text()) if save_as is not None else None


def run_serve(args: argparse.Namespace, out: Path) -> dict:
    base_url = f"http://127.0.0.1:{args.port}"
    command = server_command(args.engine, args.model, args.port, args.server_arg)
    env = _server_env(args.step_trace if args.engine == "fitserve" else None)
    env.update(VLLM_ENV)
    log_path = out / f"{args.engine}_server.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    figures: dict = {"server_command": " ".join(command[1:])}
    try:
        wait_until_ready(server, base_url, 900, log_path)
        figures["ready_s"] = round(time.monotonic() - started, 1)
        warmup = str(min(64, max(args.concurrency)))
        client(base_url, ["--num-prompts", warmup, "--max-concurrency", warmup, "--seed", "100"], None)
        for concurrency in args.concurrency:
            flags = ["--num-prompts", str(args.waves * concurrency), "--max-concurrency", str(concurrency),
                     "--seed", str(concurrency)]  # fmt: skip
            result = client(base_url, flags, out / f"{args.engine}_serve_c{concurrency}.json")
            key = f"serve_c{concurrency}"
            figures[f"{key}_out_tok_per_s"] = round(result["output_throughput"], 1)
            figures[f"{key}_mean_tpot_ms"] = round(result["mean_tpot_ms"], 2)
            figures[f"{key}_p99_ttft_ms"] = round(result["p99_ttft_ms"], 1)
            figures[f"{key}_mean_ttft_ms"] = round(result["mean_ttft_ms"], 1)
            figures[f"{key}_completed"] = result["completed"]
            print(key, {k: v for k, v in figures.items() if k.startswith(key)}, flush=True)
    finally:
        stop(server)
    log = log_path.read_text()
    if tokens := KV_TOKENS.findall(log):
        figures["kv_tokens_8b"] = int(tokens[-1].replace(",", ""))
    if gib := KV_GIB.findall(log):
        figures["kv_gib_8b"] = float(gib[-1])
    return figures


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randint(100, 10000) for _ in range(length)]


def prefill_heavy_requests() -> list[tuple[list[int], int]]:
    rng = random.Random(27)
    prefixes = [random_ids(rng, 2048) for _ in range(4)]
    requests = []
    for index in range(384):
        if index % 2 == 0:
            ids = prefixes[index % 8 // 2] + random_ids(rng, rng.randint(256, 1024))
        else:
            ids = random_ids(rng, rng.randint(512, 2048))
        requests.append((ids, rng.randint(32, 256)))
    return requests


def run_offline(args: argparse.Namespace) -> dict:
    settings = dict(
        tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=40960, max_num_batched_tokens=8192,
        gpu_memory_utilization=0.9,
    )  # fmt: skip
    started = time.monotonic()
    LLM, SamplingParams = engine_classes(args.engine)
    llm = LLM(args.model, **settings)
    figures: dict = {"settings": settings, "ready_s": round(time.monotonic() - started, 1)}

    def generate(requests: list[tuple[list[int], int]]) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - begin, sum(len(o.outputs[0].token_ids) for o in outputs)

    rng = random.Random(5)
    generate([(random_ids(rng, 1500), 16) for _ in range(64)])  # warm-up: kernels for every step shape
    heavy = prefill_heavy_requests()
    seconds, out_tokens = generate(heavy)
    figures["prefill_heavy_prompt_tokens"] = sum(len(ids) for ids, _ in heavy)
    figures["prefill_heavy_out_tokens"] = out_tokens
    figures["prefill_heavy_s"] = round(seconds, 3)
    figures["prefill_heavy_out_tok_per_s"] = round(out_tokens / seconds, 1)
    generate([(random_ids(rng, 32768), 1)])  # warm-up of the long prompt's shapes
    seconds, _ = generate([(random_ids(rng, 32768), 1)])
    figures["prefill_32k_ttft_ms"] = round(seconds * 1000, 1)
    chunks = [(random_ids(rng, 8192), 1) for _ in range(8)]
    seconds, _ = generate(chunks)
    figures["prefill_tok_per_s_8k_chunks"] = round(8 * 8192 / seconds, 1)
    print(json.dumps(figures), flush=True)
    return figures


def run_engine_only(args: argparse.Namespace) -> dict:
    """The serving workload without the server: LLM with max_num_seqs = the concurrency and the serving
    token budget (1,024), so requests start as others finish, as at a closed-loop client's concurrency."""
    from fitserve import LLM, SamplingParams

    figures: dict = {}
    for concurrency in args.concurrency:
        llm = LLM(args.model, tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=4096,
                  max_num_seqs=concurrency, max_num_batched_tokens=1024)  # fmt: skip
        rng = random.Random(concurrency)
        low, high = int(INPUT_MEAN * (1 - RANGE_RATIO)), int(INPUT_MEAN * (1 + RANGE_RATIO))
        out_low, out_high = int(OUTPUT_MEAN * (1 - RANGE_RATIO)), int(OUTPUT_MEAN * (1 + RANGE_RATIO))
        requests = [(random_ids(rng, rng.randint(low, high)), rng.randint(out_low, out_high))
                    for _ in range(args.waves * concurrency)]  # fmt: skip
        warm = [{"prompt_token_ids": ids} for ids, _ in requests[:concurrency]]
        llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        llm.engine.kv_manager.reset_prefix_cache()
        prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        figures[f"engine_only_c{concurrency}_out_tok_per_s"] = round(tokens / seconds, 1)
        print(figures, flush=True)
        del llm
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["serve", "offline", "engine-only"])
    parser.add_argument("--engine", choices=["fitserve", "vllm"], default="fitserve")
    parser.add_argument("--out", default="/tmp/load_suite", help="Folder for the result files.")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument(
        "--model", default=str(MODEL), help="The model folder (a smaller one for a smoke test)."
    )
    parser.add_argument("--waves", type=int, default=WAVES, help="Prompts per concurrency slot.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCIES))
    parser.add_argument("--step-trace", default=None, help="fitserve only: the server's step trace file.")
    parser.add_argument("--server-arg", action="append", default=[], help="Extra server flag; repeat.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {
        "serve": run_serve,
        "offline": lambda a, _: run_offline(a),
        "engine-only": lambda a, _: run_engine_only(a),
    }
    figures = runs[args.mode](args, out)
    if args.engine == "vllm":
        import vllm

        figures["vllm"] = vllm.__version__
    result = {"engine": args.engine, "mode": args.mode, "command": " ".join(sys.argv), "machine": machine(),
              "figures": figures}  # fmt: skip
    (out / f"{args.engine}_{args.mode}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
