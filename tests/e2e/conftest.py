"""Live `fitserve serve` processes on 127.0.0.1 for the end-to-end tests.

The server runs the default model (SmolLM2-135M-Instruct). Its cache folder comes, first that exists,
from the session fixture `default_model_cache` (tests/conftest.py, shared with the loader tests, so
the model is fetched and converted once per session), the env FITSERVE_CACHE_DIR, or ~/.cache/fitserve.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# The first start of a session may fetch and convert the default model.
SERVER_START_TIMEOUT_S = 900
API_KEY = "e2e-secret-key"
SERVED_NAMES = ("smol", "smol-alias")
MAX_MODEL_LEN = 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30.0) -> int:
        """Send `sig`, wait for the exit, return the exit status (kills it past the timeout)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    flags: list[str], log_path: Path, cache_dir: str, api_key: str | None, scheme: str = "http"
) -> LiveServer:
    """Starts `fitserve serve` and waits for /health (scheme "https" when flags set up TLS)."""
    port = free_port()
    command = [sys.executable, "-m", "fitserve", "serve", "--port", str(port), *flags]
    if api_key:
        command += ["--api-key", api_key]
    env = {k: v for k, v in os.environ.items() if k not in ("FITSERVE_API_KEY", "VLLM_API_KEY")}
    env["FITSERVE_CACHE_DIR"] = cache_dir
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = LiveServer(f"{scheme}://127.0.0.1:{port}", process, log_path, api_key)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"fitserve serve exited with {process.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5, verify=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            pytest.fail(f"fitserve serve not healthy in {SERVER_START_TIMEOUT_S} s:\n{server.log()[-4000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="session")
def e2e_cache_dir(request: pytest.FixtureRequest) -> str:
    try:
        return str(request.getfixturevalue("default_model_cache").root)
    except pytest.FixtureLookupError:
        return os.environ.get("FITSERVE_CACHE_DIR") or str(Path.home() / ".cache" / "fitserve")


@pytest.fixture(scope="session")
def live_server(e2e_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The shared server: API key, two served names, tool calls (hermes), the qwen3 reasoning parser
    (which leaves ordinary chat alone: only a prompt that opens <think> makes output reasoning) and
    per-request chat templates."""
    flags = [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--served-model-name",
        *SERVED_NAMES,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--trust-request-chat-template",
    ]
    log_path = tmp_path_factory.mktemp("live-server") / "server.log"
    server = start_server(flags, log_path, e2e_cache_dir, API_KEY)
    yield server
    status = server.stop(signal.SIGINT)
    assert status == 0, f"the server exited with {status} on SIGINT:\n{server.log()[-3000:]}"


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, for servers of several processes on the CPU."""
    from tests.unit.test_engine_vs_hf import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(folder, "LlamaForCausalLM")
    return folder
