"""`fitserve serve --tensor-parallel-size 2 --distributed-executor-backend ray` on the CPU: the server starts
a local Ray cluster, runs rank 1 in a Ray actor, answers as one rank does, and once the actor's process is
killed answers 503 (the rank and the reason in its log) instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import LiveServer, start_server
from tests.e2e.test_server_tensor_parallel import (
    assert_answers_503_once_rank_1_failed,
    assert_answers_as_one_rank,
    tp2_flags,
)


@pytest.fixture(scope="module")
def ray_server(tiny_llama_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    pytest.importorskip("ray")
    flags = tp2_flags(tiny_llama_folder, "--distributed-executor-backend", "ray")
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


def test_ray_server_answers_as_one_rank_does_then_503_once_its_actor_dies(tiny_llama_folder, ray_server):
    assert_answers_as_one_rank(ray_server, tiny_llama_folder)
    log = ray_server.log()
    assert "Ray: no cluster running, started a local one" in log or "Ray: joined the running cluster" in log
    assert "Tensor parallel: 2 ranks (gloo), rank 0 in this process, the others in Ray actors" in log

    actors = _rank_actor_pids(ray_server.process.pid)
    assert len(actors) == 1, "the server's rank 1 actor was not found among its processes"
    os.kill(actors[0], signal.SIGKILL)
    assert_answers_503_once_rank_1_failed(ray_server, "its Ray actor")
