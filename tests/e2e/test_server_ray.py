"""`fitserve serve --tensor-parallel-size 2 --distributed-executor-backend ray` on the CPU: the server starts
a local Ray cluster, runs rank 1 in a Ray actor, answers as one rank does, and once the actor's process is
killed answers 503 (the rank and the reason in its log) instead of hanging."""

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


@pytest.fixture(scope="module")
def ray_server(tiny_llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    pytest.importorskip("ray")
    flags = [
        str(tiny_llama_folder),
        "--served-model-name",
        "m",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
    ]
    log_path = tmp_path_factory.mktemp("ray-server") / "server.log"
    server = start_server(flags, log_path, str(tmp_path_factory.mktemp("cache")), None)
    yield server
    server.stop(signal.SIGINT)  # ends the local Ray cluster it started with it


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        listed = subprocess.run(["pgrep", "-P", str(frontier.pop())], capture_output=True, text=True)
        children = [int(each) for each in listed.stdout.split()]
        found += children
        frontier += children
    return found


def _rank_actor_pids(server_pid: int) -> list[int]:
    """The server's Ray worker processes running a rank (Ray titles them after the actor's method)."""
    pids = []
    for pid in _descendants(server_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::_RankActor"):
            pids.append(pid)
    return pids


def _complete(server: LiveServer) -> httpx.Response:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_ray_server_answers_as_one_rank_does_then_503_once_its_actor_dies(tiny_llama_folder, ray_server):
    reply = _complete(ray_server)
    assert reply.status_code == 200, reply.text
    llm = LLM(str(tiny_llama_folder), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].text
    assert reply.json()["choices"][0]["text"] == expected
    log = ray_server.log()
    assert "Ray: no cluster running, started a local one" in log or "Ray: joined the running cluster" in log
    assert "Tensor parallel: 2 ranks (gloo), rank 0 in this process, the others in Ray actors" in log

    actors = _rank_actor_pids(ray_server.process.pid)
    assert len(actors) == 1, "the server's rank 1 actor was not found among its processes"
    os.kill(actors[0], signal.SIGKILL)
    started = time.monotonic()
    failed = _complete(ray_server)
    assert failed.status_code in (500, 503), failed.text
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 30
    while httpx.get(f"{ray_server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health still answers 200 with the rank's actor gone"
        time.sleep(0.2)
    assert "tensor-parallel rank 1 failed: its Ray actor" in ray_server.log()
    assert _complete(ray_server).status_code == 503
