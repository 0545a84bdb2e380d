"""`fitserve bench serve` against a live fitserve server on 127.0.0.1 with the default model.

The server is the real one (`python -m fitserve serve --port P`, SmolLM2-135M-Instruct); the benchmark
runs through its command-line entry, in this process. Small lengths keep the CPU run to seconds. Checked:
the counts in the result file, TTFT <= E2EL for every request, ordered percentiles, failures counted apart.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import fitserve
from fitserve.bench.cli_bench import bench_main

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
# The first start may fetch and convert the default model once.
SERVER_START_TIMEOUT_S = 900
PERCENTILES = ("50", "90", "99")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "fitserve", "serve", "--port", str(port)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(
                    f"fitserve serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"fitserve serve not ready in {SERVER_START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench(server_url: str, result_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """Runs `fitserve bench serve ...` in this process (no second torch import); returns its stdout."""
    argv = [
        "serve", "--base-url", server_url, "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(result_path.parent), "--result-filename", result_path.name,
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(PERCENTILES), *flags,
    ]  # fmt: skip
    status = bench_main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.out[-2000:] + captured.err[-2000:]
    return captured.out


def check_timings(result: dict) -> None:
    succeeded = [index for index, error in enumerate(result["errors"]) if not error]
    for index in succeeded:
        assert 0 < result["ttfts"][index] <= result["latencies"][index]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = [result[f"p{p}_{metric}_ms"] for p in PERCENTILES]
        assert values == sorted(values), (metric, values)
        assert result[f"mean_{metric}_ms"] > 0 and result[f"median_{metric}_ms"] > 0


def test_random_prompts_counts_match_what_was_asked(server_url: str, tmp_path: Path, capsys):
    result_path = tmp_path / "random.json"
    lengths = ("--random-input-len", "16", "--random-output-len", "8")
    stdout = bench(server_url, result_path, capsys, "--num-prompts", "8", *lengths)
    result = json.loads(result_path.read_text())
    assert (result["num_prompts"], result["completed"], result["failed"]) == (8, 8, 0)
    # the input counts are the server's usage.prompt_tokens
    assert result["input_lens"] == [16] * 8 and result["total_input_tokens"] == 128
    assert result["output_lens"] == [8] * 8 and result["total_output_tokens"] == 64  # eos ignored: exactly 8
    assert result["server_version"] == fitserve.__version__
    models = httpx.get(f"{server_url}/v1/models", timeout=5).json()["data"]
    assert result["model_id"] == models[0]["id"]
    check_timings(result)
    assert result["output_throughput"] == pytest.approx(64 / result["duration"])
    assert "Successful requests:                     8" in stdout


def test_chat_backend_under_a_concurrency_limit(server_url: str, tmp_path: Path, capsys):
    result_path = tmp_path / "chat.json"
    flags = ("--backend", "openai-chat", "--num-prompts", "4", "--max-concurrency", "2")
    bench(server_url, result_path, capsys, *flags, "--random-input-len", "16", "--random-output-len", "8")
    result = json.loads(result_path.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 32)
    assert result["max_concurrent_requests"] <= 2
    # the chat template wraps each 16-token prompt, and the server's usage says so
    assert all(length > 16 for length in result["input_lens"])
    check_timings(result)


def test_refused_requests_are_failures_not_latencies(server_url: str, tmp_path: Path, capsys):
    result_path = tmp_path / "too_long.json"
    max_model_len = httpx.get(f"{server_url}/v1/models", timeout=5).json()["data"][0]["max_model_len"]
    too_long = str(max_model_len + 100)
    lengths = ("--random-input-len", too_long, "--random-output-len", "4")
    stdout = bench(server_url, result_path, capsys, "--num-prompts", "2", *lengths)
    result = json.loads(result_path.read_text())
    assert (result["completed"], result["failed"], result["failures"]) == (0, 2, {"http_error": 2})
    assert result["total_output_tokens"] == 0 and result["mean_e2el_ms"] == 0
    assert all(error.startswith("HTTP 400") for error in result["errors"])
    assert "Failed requests: 2 (http_error 2)" in stdout
