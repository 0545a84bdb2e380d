"""`fitserve bench serve` on the GPU machine: Llama-3.1-8B shape, random 1024 in / 1024 out, at 1 and 32.

Starts `fitserve serve MODEL --load-format dummy --tokenizer TOKENIZER`, waits until it answers, warms it
up (prompts of another seed, so the measured runs get no prefix-cache hits), then runs
  concurrency 1:  --max-concurrency 1  --num-prompts 8   (--num-prompts-c1)
  concurrency 32: --max-concurrency 32 --num-prompts 128 (--num-prompts-c32)
with `python -m fitserve.bench serve` (the same code as `fitserve bench serve`), stops the server and
writes, under --results-dir:
  bench_serve_gpu_c1.json, bench_serve_gpu_c32.json   the bench serve result files (vLLM's keys)
  bench_serve_gpu.json                                the summary: machine, commands, figures, the vLLM
                                                      0.26.0 figures of issue 6 and whether each goal is met
  bench_serve_gpu_server.log                          the server's log

Usage, from the repository root on the GPU machine (paths relative to it):
  python benchmarks/bench_serve_gpu.py --model shared/models/llama-3.1-8b \
      --tokenizer shared/tokenizers/smollm2 [--port 8011] [--results-dir benchmarks/results] \
      [--server-arg=--enforce-eager ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 1024
# Issue 6: vLLM 0.26.0 on the same machine kind, and fitserve's goals (ms and tok/s).
VLLM_0_26 = {
    "c1": {"output_throughput": 153.0, "mean_ttft_ms": 46.9, "mean_tpot_ms": 6.50},
    "c32": {"output_throughput": 3338.0, "mean_ttft_ms": 503.0, "p99_ttft_ms": 782.0, "mean_tpot_ms": 9.10},
}
GOALS = {"c1": {"mean_tpot_ms": 5.7}, "c32": {"mean_ttft_ms": 300.0, "mean_tpot_ms": 8.5}}  # upper limits
WARMUP_OUTPUT_LEN = 16
WARMUP_SEED = 100
REPORTED_KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
    "p99_e2el_ms",
)  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="shared/models/llama-3.1-8b", help="Folder with the shape's config.json."
    )
    parser.add_argument("--tokenizer", default="shared/tokenizers/smollm2", help="Tokenizer folder.")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--results-dir", default="benchmarks/results")
    parser.add_argument(
        "--input-len", type=int, default=DEFAULT_INPUT_LEN, help="Smaller only for a smoke test."
    )
    parser.add_argument(
        "--output-len", type=int, default=DEFAULT_OUTPUT_LEN, help="Smaller only for a smoke test."
    )
    parser.add_argument(
        "--warmup-prompts", type=int, default=32, help="Warm-up requests (another seed), 0 = none."
    )
    parser.add_argument("--num-prompts-c1", type=int, default=8)
    parser.add_argument("--num-prompts-c32", type=int, default=128)
    parser.add_argument(
        "--startup-timeout", type=float, default=900.0, help="Seconds to wait for the server."
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="Extra `fitserve serve` flag; repeat."
    )
    parser.add_argument("--plot", action="store_true", help="Also draw a PNG per run (needs matplotlib).")
    parser.add_argument(
        "--save-detailed", action="store_true", help="Keep per-request times in the result files."
    )
    parser.add_argument(
        "--step-trace",
        default=None,
        help="Have the server append one line per engine step to this file (benchmarks/gpu/step_trace; "
        "read it with benchmarks/gpu/tpot_breakdown.py and --save-detailed results).",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    model, tokenizer = Path(args.model), Path(args.tokenizer)
    if not (model / "config.json").is_file():
        sys.exit(f"--model {model} has no config.json: point it at the Llama-3.1-8B shape's folder")
    if not (tokenizer / "tokenizer.json").is_file():
        sys.exit(f"--tokenizer {tokenizer} has no tokenizer.json: point it at shared/tokenizers/smollm2")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{args.port}"
    server_command = [
        sys.executable, "-m", "fitserve", "serve", str(model), "--load-format", "dummy",
        "--tokenizer", str(tokenizer), "--port", str(args.port), "--max-model-len", str(args.max_model_len),
        *args.server_arg,
    ]  # fmt: skip
    log_path = results_dir / "bench_serve_gpu_server.log"
    print("Server:", " ".join(server_command), flush=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        env = _server_env(args.step_trace)
        server = subprocess.Popen(
            server_command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        wait_until_ready(server, base_url, args.startup_timeout, log_path)
        ready_s = time.monotonic() - started
        print(f"Server ready in {ready_s:.1f} s", flush=True)
        if args.warmup_prompts > 0:
            warmup = ["--num-prompts", str(args.warmup_prompts), "--max-concurrency", "32",
                      "--seed", str(WARMUP_SEED), "--random-input-len", str(args.input_len),
                      "--random-output-len", str(WARMUP_OUTPUT_LEN)]  # fmt: skip
            bench(base_url, tokenizer, warmup, save_as=None, plot=False, detailed=False)
        runs: dict[str, dict[str, Any]] = {}
        for name, concurrency, prompts, seed in (
            ("c1", 1, args.num_prompts_c1, 1),
            ("c32", 32, args.num_prompts_c32, 2),
        ):
            flags = ["--max-concurrency", str(concurrency), "--num-prompts", str(prompts),
                     "--seed", str(seed), "--random-input-len", str(args.input_len),
                     "--random-output-len", str(args.output_len)]  # fmt: skip
            path = results_dir / f"bench_serve_gpu_{name}.json"
            bench(base_url, tokenizer, flags, save_as=path, plot=args.plot, detailed=args.save_detailed)
            runs[name] = json.loads(path.read_text())
    finally:
        stop(server)
    workload = f"random {args.input_len} in / {args.output_len} out, eos ignored"
    summary = summarize(runs, server_command, ready_s, workload)
    summary_path = results_dir / "bench_serve_gpu.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({name: summary["runs"][name]["goals"] for name in summary["runs"]}, indent=2))
    print(f"Summary saved to {summary_path}")
    return 0


def wait_until_ready(server: subprocess.Popen, base_url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(
                f"fitserve serve exited with {server.returncode}; its log:\n{log_path.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    stop(server)
    sys.exit(f"fitserve serve was not ready within {timeout_s:g} s; its log is {log_path}")


def bench(
    base_url: str, tokenizer: Path, flags: list[str], save_as: Path | None, plot: bool, detailed: bool
) -> None:
    command = [sys.executable, "-m", "fitserve.bench", "serve", "--base-url", base_url, "--tokenizer",
               str(tokenizer), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", *flags]  # fmt: skip
    if save_as is not None:
        command += ["--save-result", "--result-dir", str(save_as.parent), "--result-filename", save_as.name]
        if plot:
            command += ["--plot", str(save_as.with_suffix(".png"))]
        if detailed:
            command.append("--save-detailed")
    print("Bench:", " ".join(command), flush=True)
    subprocess.run(command, cwd=REPO_ROOT, check=True, env=_env())


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def summarize(
    runs: dict[str, dict[str, Any]], server_command: list[str], ready_s: float, workload: str
) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "benchmark": "bench_serve_gpu",
        "machine": machine_info(),
        "server_command": " ".join(server_command),
        "server_ready_s": ready_s,
        "workload": workload,
        "runs": {},
    }
    for name, result in runs.items():
        figures = {key: result.get(key) for key in REPORTED_KEYS}
        goals = {
            f"{key} <= {limit}": {
                "measured": figures[key],
                "met": figures[key] is not None and figures[key] <= limit,
            }
            for key, limit in GOALS[name].items()
        }
        summary["runs"][name] = {
            "command": result["command"],
            "max_concurrency": result.get("max_concurrency"),
            "num_prompts": result.get("num_prompts"),
            "figures": figures,
            "vllm_0_26": VLLM_0_26[name],
            "goals": goals,
        }
    return summary


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        import triton

        info["triton"] = triton.__version__
    except ImportError as error:
        info["missing"] = str(error)
    return info


def _server_env(step_trace: str | None) -> dict[str, str]:
    env = _env()
    if step_trace is not None:
        Path(step_trace).unlink(missing_ok=True)
        env["FITSERVE_STEP_TRACE"] = str(Path(step_trace).resolve())
        hook = REPO_ROOT / "benchmarks" / "gpu" / "step_trace"
        env["PYTHONPATH"] = f"{hook}{os.pathsep}{env['PYTHONPATH']}"
    return env


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)}


if __name__ == "__main__":
    sys.exit(main())
