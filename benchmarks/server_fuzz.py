"""Fuzz `fitserve serve` with schemathesis against its own /openapi.json: no 5xx, no response that breaks
the schema the server publishes.

Starts `fitserve serve` on the default model (SmolLM2-135M-Instruct; works offline once cached) with
`--api-key` and a short `--max-model-len` (so generated requests finish in a second on the CPU), then
runs `st run` in positive mode (valid requests) and negative mode (requests that break the schema),
`--max-examples` cases per operation and mode, with the API key, checking `not_a_server_error` and
`response_schema_conformance` (plus status codes and content types the schema declares). Saves the
command, the versions, the case counts and the failures to benchmarks/results/cpu_server_fuzz.json.

    python benchmarks/server_fuzz.py                  # about 10 minutes on 2 cores
    python benchmarks/server_fuzz.py --max-examples 50
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULT = REPO_ROOT / "benchmarks" / "results" / "cpu_server_fuzz.json"
API_KEY = "fuzz-secret-key"
CHECKS = (
    "not_a_server_error",
    "response_schema_conformance",
    "status_code_conformance",
    "content_type_conformance",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, log_path: Path, max_model_len: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "fitserve", "serve", "--port", str(port), "--api-key", API_KEY]
    command += ["--max-model-len", str(max_model_len), "--disable-log-requests"]
    command += ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"fitserve serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("fitserve serve did not become healthy in 900 s")


def run_mode(url: str, mode: str, max_examples: int, seed: int, workers: int, workdir: Path) -> dict:
    report = workdir / f"{mode}.ndjson"
    command = [
        shutil.which("st") or "st",
        "run",
        f"{url}/openapi.json",
        "--mode",
        mode,
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--checks",
        ",".join(CHECKS),
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--workers",
        str(workers),
        "--request-timeout",
        "60",
        "--continue-on-failure",
        "--phases",
        "examples,coverage,fuzzing",
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(report),
    ]
    started = time.monotonic()
    # run in the scratch folder: schemathesis keeps a .schemathesis/ cache where it runs
    completed = subprocess.run(command, capture_output=True, text=True, cwd=workdir)
    elapsed = time.monotonic() - started
    cases, failures, errors = count_cases(report)
    shown = [part.replace(API_KEY, "<key>") for part in command]
    shown[0] = "st"
    return {
        "mode": mode,
        "command": " ".join(shown),
        "exit_status": completed.returncode,
        "seconds": round(elapsed, 1),
        "cases": cases,
        "failures": failures,
        "errors": errors,
        "summary": completed.stdout.strip().splitlines()[-12:],
    }


def count_cases(report: Path) -> tuple[int, list[dict], list[dict]]:
    """Cases sent (one HTTP request each), the distinct check failures, and schemathesis' own errors (a
    network error, a flaky case), from its ndjson events."""
    cases = 0
    failures: dict[tuple[str, str], dict] = {}
    errors: list[dict] = []
    if not report.exists():
        return 0, [{"error": "no report written"}], []
    for line in report.read_text().splitlines():
        event = json.loads(line)
        error = event.get("NonFatalError")
        if error:
            value = error.get("value") or {}
            errors.append({"operation": error.get("label"), "phase": error.get("phase"), **value})
        scenario = event.get("ScenarioFinished")
        if not scenario:
            continue
        recorder = scenario.get("recorder") or {}
        cases += len(recorder.get("interactions") or {})
        label = scenario.get("label") or recorder.get("label") or "?"
        for check_list in (recorder.get("checks") or {}).values():
            for check in check_list:
                if check.get("status") == "success":
                    continue
                detail = (check.get("failure_info") or {}).get("failure") or {}
                title = detail.get("title") or check.get("name", "?")
                key = (label, check.get("name"), title)
                failures.setdefault(
                    key,
                    {
                        "operation": label,
                        "check": check.get("name"),
                        "title": title,
                        "message": str(detail.get("message", ""))[:400],
                        "count": 0,
                    },
                )
                failures[key]["count"] += 1
    return cases, list(failures.values()), errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation and mode")
    parser.add_argument("--max-model-len", type=int, default=64, help="short: generated requests end fast")
    parser.add_argument("--workers", type=int, default=4, help="concurrent schemathesis workers")
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--modes", default="positive,negative")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--fixed", default="", help="a note on what earlier runs found and was fixed")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fitserve-fuzz-"))
    port = free_port()
    process = start_server(port, workdir / "server.log", args.max_model_len)
    try:
        url = f"http://127.0.0.1:{port}"
        runs = [
            run_mode(url, mode, args.max_examples, args.seed, args.workers, workdir)
            for mode in args.modes.split(",")
        ]
        healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    log = (workdir / "server.log").read_text(errors="replace")
    result = {
        "script": "benchmarks/server_fuzz.py",
        "command": " ".join(["python", "benchmarks/server_fuzz.py", *sys.argv[1:]]),
        "server": f"fitserve serve --api-key <key> --max-model-len {args.max_model_len} (default model)",
        "versions": {
            name: importlib.metadata.version(name)
            for name in ("fitserve", "schemathesis", "hypothesis", "fastapi", "pydantic")
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "checks": list(CHECKS),
        "runs": runs,
        "total_cases": sum(run["cases"] for run in runs),
        "total_failures": sum(len(run["failures"]) for run in runs),
        "total_errors": sum(len(run["errors"]) for run in runs),
        "server_healthy_after": healthy,
        "server_exit_status": process.returncode,
        "server_tracebacks": log.count("Traceback"),
        "fixed_before_this_run": args.fixed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("total_cases", "total_failures", "server_healthy_after")}))
    for run in runs:
        for failure in run["failures"]:
            print(f"[{run['mode']}] {failure['operation']}: {failure['title']}")


if __name__ == "__main__":
    main()
