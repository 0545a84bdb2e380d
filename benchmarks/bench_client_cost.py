"""What `fitserve bench serve`'s client costs per streamed token: the CPU seconds its process spends per
server-sent event, over httpx and over its plain HTTP/1.1 path (fitserve/bench/sse_http.py), against one
live `fitserve serve` of a tiny random Llama (2 layers, hidden 64, SmolLM2's 49,152-token vocabulary) on
this machine's CPU, the same requests in turn.

A client that needs C seconds per event reads at most 1 / C events a second from one core: a server
streaming faster is measured by the client (its requests start late, their TTFT holds the client's
backlog). The server's event loop (HTTP, SSE events) and the whole server are counted beside it. On the
H200 of benchmarks/results/h200_load_suite_vs_vllm_2026_11_27.json a busy server streams 5,000 to 20,000
tokens a second.

  python benchmarks/bench_client_cost.py [--prompts 256] [--concurrency 128] [--output-len 128]
      [--out benchmarks/results/cpu_bench_client.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from cpu_startup import free_port, start_server, stop
from transformers import LlamaConfig, LlamaForCausalLM

from fitserve.bench.client import RequestInput
from fitserve.bench.serve import run_requests

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = next(
    path / "tokenizers" / "smollm2" for path in (REPO.parent / "shared", REPO / "shared") if path.is_dir()
)


def tiny_model(folder: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def requests(port: int, count: int, output_len: int) -> list[RequestInput]:
    return [
        RequestInput(
            backend="openai",
            api_url=f"http://127.0.0.1:{port}/v1/completions",
            model="tiny",
            prompt=f"Request {index}: tell me a story about the number {index}.",
            prompt_len=16,
            output_len=output_len,
            sampling={"ignore_eos": True, "temperature": 0.0},
            headers={},
            timeout_s=3600.0,
        )
        for index in range(count)
    ]


def cpu_s(stat: Path) -> float:
    """User + system CPU seconds in a Linux /proc stat file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_s(server_pid: int) -> dict[str, float]:
    """CPU seconds of the server's main thread (its event loop: HTTP, SSE events; on the CPU the engine
    runs on other threads of the process) and of the whole server (its engine process included, on a
    GPU)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    whole = sum(cpu_s(Path(f"/proc/{pid}/stat")) for pid in [server_pid, *children])
    return {"loop": cpu_s(Path(f"/proc/{server_pid}/task/{server_pid}/stat")), "whole": whole}


async def timed_run(inputs: list[RequestInput], concurrency: int, raw_http: bool, server_pid: int) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency)) as client:
        server_before = server_cpu_s(server_pid)
        cpu_before, started = time.process_time(), time.perf_counter()
        results, _ = await run_requests(client, inputs, [0.0] * len(inputs), concurrency, True, raw_http)
        cpu = time.process_time() - cpu_before
        wall = time.perf_counter() - started
        server_after = server_cpu_s(server_pid)
    events = sum(len(result.itl) + 1 for result in results if result.success)
    loop_cpu = server_after["loop"] - server_before["loop"]
    return {
        "client": "plain HTTP/1.1 (sse_http.py)" if raw_http else "httpx",
        "completed": sum(result.success for result in results),
        "token_events": events,
        "client_cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "client_cpu_us_per_event": round(cpu / events * 1e6, 1),
        "events_per_client_cpu_s": round(events / cpu),
        "server_event_loop_cpu_us_per_event": round(loop_cpu / events * 1e6, 1),
        "server_cpu_s": round(server_after["whole"] - server_before["whole"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fitserve-client-cost-") as scratch:
        model = tiny_model(Path(scratch) / "tiny")
        port = free_port()
        command = [sys.executable, "-m", "fitserve", "serve", str(model), "--port", str(port),
                   "--served-model-name", "tiny", "--max-num-seqs", "256",
                   "--max-model-len", "1024"]  # fmt: skip
        server, ready_s = start_server(command, dict(os.environ), port, Path(scratch) / "log")
        try:
            warm = requests(port, 16, 8)
            asyncio.run(timed_run(warm, 16, True, server.pid))
            inputs = requests(port, args.prompts, args.output_len)
            runs = [
                asyncio.run(timed_run(inputs, args.concurrency, raw, server.pid)) for raw in (False, True)
            ]
        finally:
            stop(server)
    figures = {
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "command": "python benchmarks/bench_client_cost.py " + " ".join(sys.argv[1:]),
        "server_ready_s": round(ready_s, 1),
        "workload": {"prompts": args.prompts, "concurrency": args.concurrency, "output_len": args.output_len},
        "runs": runs,
        "httpx_over_plain_cpu_per_event": round(
            runs[0]["client_cpu_us_per_event"] / runs[1]["client_cpu_us_per_event"], 2
        ),
    }
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
