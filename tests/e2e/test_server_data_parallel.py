"""`fitserve serve --data-parallel-size 2` on the CPU: two engine processes behind one server, both
answering as one engine does, their load in one /metrics; one killed turns /health to 503."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from fitserve import LLM, SamplingParams
from tests.e2e.conftest import LiveServer, start_server

PROMPTS = [[5, 17, 33, 2, 90, 41, 8], [9, 9, 4], [100, 3, 7, 7, 61], [250, 1]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def dp2_server(tiny_llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    flags = [str(tiny_llama_folder), "--served-model-name", "m", "--data-parallel-size", "2"]
    flags += ["--dtype", "float32", "--max-model-len", "256"]
    log_path = tmp_path_factory.mktemp("dp2-server") / "server.log"
    server = start_server(flags, log_path, str(tmp_path_factory.mktemp("cache")), None)
    yield server
    server.stop(signal.SIGKILL if server.process.poll() is None else signal.SIGINT)


def _complete(server: LiveServer, prompt: list[int]) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


def _engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes (not multiprocessing's resource tracker)."""
    children = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    return [
        int(pid) for pid in children if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_two_replicas_answer_as_one_engine_and_count_in_one_metrics(tiny_llama_folder, dp2_server):
    assert "Data parallel: 2 engine replicas" in dp2_server.log()
    assert len(_engine_pids(dp2_server.process.pid)) == 2, "expected one engine process per replica"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda prompt: _complete(dp2_server, prompt), PROMPTS))
    llm = LLM(str(tiny_llama_folder), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert [reply.json()["choices"][0]["text"] for reply in replies] == expected
    metrics = httpx.get(f"{dp2_server.url}/metrics", timeout=10).text
    assert _metric(metrics, "vllm:generation_tokens_total") == len(PROMPTS) * MAX_TOKENS


def test_a_dead_replica_takes_the_server_to_503(dp2_server):
    os.kill(_engine_pids(dp2_server.process.pid)[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(f"{dp2_server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still answers 200 with a replica gone"
        time.sleep(0.2)
