"""`fitserve serve --tensor-parallel-size 2` on the CPU (gloo ranks): the same greedy completion as one
rank, and a rank killed mid-life turns the server's answers into 503s instead of hanging them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fitserve import LLM, SamplingParams
from tests.e2e.conftest import LiveServer, start_server

PROMPT = [5, 17, 33, 2, 90, 41, 8]
MAX_TOKENS = 16


def tp2_flags(folder: Path, *extra: str) -> list[str]:
    """The flags of a TP 2 server of the tiny model (also the Ray backend's: tests/e2e/test_server_ray.py)."""
    model = [str(folder), "--served-model-name", "m", "--dtype", "float32", "--max-model-len", "256"]
    return [*model, "--tensor-parallel-size", "2", *extra]


@pytest.fixture(scope="module")
def tp2_server(tiny_llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log_path = tmp_path_factory.mktemp("tp2-server") / "server.log"
    server = start_server(tp2_flags(tiny_llama_folder), log_path, str(tmp_path_factory.mktemp("cache")), None)
    yield server
    server.stop(signal.SIGKILL if server.process.poll() is None else signal.SIGINT)


def _rank_pids(server_pid: int) -> list[int]:
    listed = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True, check=False)
    return [int(pid) for pid in listed.stdout.split()]


def _complete(server: LiveServer) -> httpx.Response:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def assert_answers_as_one_rank(server: LiveServer, folder: Path) -> None:
    """The server's greedy completion is the one rank's (LLM in this process)."""
    reply = _complete(server)
    assert reply.status_code == 200, reply.text
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].text
    assert reply.json()["choices"][0]["text"] == expected


def assert_answers_503_once_rank_1_failed(server: LiveServer, reason: str) -> None:
    """After a rank was killed: the next request fails within 30 s instead of hanging, /health turns 503,
    the log names rank 1 and `reason`, and later requests get 503."""
    started = time.monotonic()
    failed = _complete(server)
    assert failed.status_code in (500, 503), failed.text
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still answers 200 with a rank gone"
        time.sleep(0.2)
    assert f"tensor-parallel rank 1 failed: {reason}" in server.log()
    assert _complete(server).status_code == 503


def test_tp2_server_answers_as_one_rank_does_then_503_once_a_rank_dies(tiny_llama_folder, tp2_server):
    assert_answers_as_one_rank(tp2_server, tiny_llama_folder)
    assert "Tensor parallel: 2 ranks (gloo)" in tp2_server.log()

    ranks = _rank_pids(tp2_server.process.pid)
    assert ranks, "the server started no rank process"
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    assert_answers_503_once_rank_1_failed(tp2_server, "its process exited")
