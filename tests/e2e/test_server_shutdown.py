"""SIGTERM with requests in flight: a final chunk for each, exit status 0, within seconds. The server
here listens on 0.0.0.0 without an API key, which must print a warning, and speaks TLS
(--ssl-keyfile/--ssl-certfile with a self-signed certificate made by openssl)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server

pytestmark = pytest.mark.e2e


def self_signed_certificate(folder: Path) -> tuple[str, str]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return str(key), str(cert)


def test_sigterm_ends_in_flight_requests_and_exits_zero(e2e_cache_dir: str, tmp_path: Path) -> None:
    key, cert = self_signed_certificate(tmp_path)
    flags = ["--host", "0.0.0.0", "--max-model-len", "512", "--ssl-keyfile", key, "--ssl-certfile", cert]
    server = start_server(flags, tmp_path / "server.log", e2e_cache_dir, None, scheme="https")
    try:
        assert "without an API key" in server.log()
        assert "Serving HuggingFaceTB/SmolLM2-135M-Instruct at https://127.0.0.1:" in server.log()
        stream_lines: list[str] = []
        whole: dict = {}

        def stream() -> None:
            body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            url = server.url + "/v1/chat/completions"
            with httpx.stream("POST", url, json=body, timeout=60, verify=False) as response:
                for line in response.iter_lines():
                    if line:
                        stream_lines.append(line)

        def non_stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
            whole.update(
                httpx.post(server.url + "/v1/completions", json=body, timeout=60, verify=False).json()
            )

        threads = [threading.Thread(target=stream), threading.Thread(target=non_stream)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(stream_lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        status = server.stop(signal.SIGTERM, timeout_s=30)
        elapsed = time.monotonic() - started
        for thread in threads:
            thread.join(timeout=10)
    finally:
        server.stop(signal.SIGKILL)
    assert status == 0, server.log()[-3000:]
    assert elapsed < 10, f"shutdown took {elapsed:.1f} s"
    assert stream_lines[-1] == "data: [DONE]"
    last = json.loads(stream_lines[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert whole["choices"][0]["finish_reason"] == "abort"
    assert 0 < whole["usage"]["completion_tokens"] < 400
    assert "Received SIGTERM: shutting down" in server.log()
