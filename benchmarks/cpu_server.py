"""CPU server figures for SmolLM2-135M-Instruct (issue 3): chat streaming speed.

Measures, on this machine, TTFT and output tokens/s at 1 and 8 concurrent chat streams, through
`fitserve bench serve` (backend openai-chat, 64 prompt tokens, 64 output tokens, eos ignored).
Start-up times are cpu_startup.py's (results/cpu_startup.json).

Usage: python benchmarks/cpu_server.py [--out benchmarks/results/cpu_server.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_startup import free_port, start_server, stop

REPO = Path(__file__).resolve().parents[1]


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
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_server.json"))
    args = parser.parse_args()
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="fitserve-cpu-server-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "fitserve", "serve", "--port", str(port), "--max-model-len", "2048"]
    process, _ = start_server(command, env, port, work / "server.log")
    try:
        figures = {"chat_streams": [bench(port, 1, 4, work), bench(port, 8, 16, work)]}
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
