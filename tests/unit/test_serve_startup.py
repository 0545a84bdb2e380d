"""What `fitserve serve` does before /health answers, kept small for a fast warm start (issue 24: warm
start <= 5 s on 2 cores): the collector paused while it starts, no `fitserve bench` parsers (httpx), no
xgrammar until the server is up, no HF hub client for a model that is not in the HF cache, and the token
byte table made on the tokenizer's thread."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from fitserve.cli.main import main
from fitserve.engine.engine import _load_tokenizer_and_table
from fitserve.models import loader
from fitserve.models.gguf_convert import collector_on
from fitserve.server import startup_gc
from fitserve.server.api_server import GRAMMAR_PRELOAD_DELAY_S, freeze_startup_heap, preload_grammar_backend
from fitserve.structured.manager import StructuredOutputManager
from fitserve.token_bytes import _tables
from tests.paths import REPO_DIR, SMOLLM2_TOKENIZER_DIR
from tests.unit.server_helpers import smollm2_tokenizer
from tests.unit.test_engine_vs_hf import save_tiny_model


def run_python(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO_DIR,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


# ---- imports ------------------------------------------------------------------------------------------


def test_the_cli_module_imports_no_torch() -> None:
    """main() pauses the collector before torch loads, so the module itself must not import it."""
    out = run_python("import sys, fitserve.cli.main; print('torch' in sys.modules)")
    assert out.strip() == "False"


def test_parsing_serve_leaves_out_the_bench_parsers() -> None:
    code = (
        "import sys\n"
        "from fitserve.cli.main import parse_command\n"
        "command, _, namespace = parse_command(['serve', '--port', '8001'])\n"
        "print(command, namespace.port, [m for m in ('fitserve.bench', 'httpx') if m in sys.modules])\n"
    )
    assert run_python(code).strip() == "serve 8001 []"


def test_top_level_help_still_lists_bench(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_no_hub_client_for_a_repo_the_hf_cache_lacks(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from fitserve.models.hub import cached_snapshot\n"
        "found = cached_snapshot('HuggingFaceTB/SmolLM2-135M-Instruct', None, ('config.json',))\n"
        "print(found, 'huggingface_hub._snapshot_download' in sys.modules)\n"
    )
    assert run_python(code, env={"HF_HUB_CACHE": str(tmp_path)}).strip() == "None False"


# ---- the garbage collector ----------------------------------------------------------------------------


def test_pause_and_resume_leave_a_disabled_collector_disabled() -> None:
    assert gc.isenabled()
    startup_gc.pause()
    assert not gc.isenabled() and startup_gc.paused()
    startup_gc.resume()
    assert gc.isenabled() and not startup_gc.paused()
    gc.disable()  # disabled by someone else: not ours to enable
    try:
        startup_gc.pause()
        startup_gc.resume()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_freeze_resumes_a_paused_collector() -> None:
    startup_gc.pause()
    try:
        freeze_startup_heap()
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        startup_gc.resume()


def test_a_start_refused_by_its_flags_resumes_the_collector(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0"])
    assert exit_info.value.code == 2
    assert "--port 0 is outside" in capsys.readouterr().err
    assert gc.isenabled()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_a_conversion_collects_inside_a_paused_start() -> None:
    """A GGUF conversion turns the paused collector on, and frees its cycles before the start goes on."""
    startup_gc.pause()
    try:
        with collector_on():
            assert gc.isenabled()
            first, second = Node(), Node()
            first.other, second.other = second, first
            dead = weakref.ref(first)
            del first, second
        assert not gc.isenabled()
        assert dead() is None
    finally:
        startup_gc.resume()
    assert gc.isenabled()


# ---- the grammar backend and the token byte table --------------------------------------------------------


def test_the_grammar_manager_preloads_only_when_asked() -> None:
    tokenizer = smollm2_tokenizer()
    manager = StructuredOutputManager(tokenizer, len(tokenizer), frozenset({2}), preload=False)
    assert manager._preloading is None
    job = manager.preload()
    assert manager.preload() is job  # once
    job.result(timeout=120)
    assert "xgrammar" in sys.modules


def test_the_servers_grammar_import_is_not_a_daemon_thread() -> None:
    """A daemon thread inside xgrammar's C++ start-up when the interpreter finalizes aborts the process
    (exit 134): a SIGINT about a second after /health did, before the thread was made a non-daemon."""
    thread = preload_grammar_backend()
    assert thread.name == "fitserve-xgrammar-import" and not thread.daemon
    thread.join(timeout=120)
    assert not thread.is_alive() and "xgrammar" in sys.modules


def test_the_tokenizer_thread_builds_the_token_byte_table() -> None:
    tokenizer = _load_tokenizer_and_table(str(SMOLLM2_TOKENIZER_DIR), False, True)
    entry = _tables.get(id(tokenizer))
    assert entry is not None and entry[0]() is tokenizer and entry[2] is not None


# ---- torch's threads while the weights load ------------------------------------------------------------


@pytest.mark.parametrize(("cores", "device", "expected"), [(2, "cpu", 1), (1, "cpu", 1), (2, "meta", 2)])
def test_weights_load_on_one_core_fewer(
    monkeypatch: pytest.MonkeyPatch, cores: int, device: str, expected: int
) -> None:
    """One core is left to the tokenizer's and the web app's threads (never below one thread, and only
    for a load on the CPU); the count is given back after, an error included."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(loader.os, "cpu_count", lambda: cores)
    try:
        with pytest.raises(RuntimeError, match="in the block"), loader.loading_threads(torch.device(device)):
            assert torch.get_num_threads() == expected
            raise RuntimeError("in the block")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---- a whole start ----------------------------------------------------------------------------------------

# Starts `fitserve serve FOLDER` in this process; at the first /health 200 it notes the collector's state
# and which modules are loaded, then waits for the delayed xgrammar import and stops the server.
DRIVER = r"""
import gc, json, os, signal, sys, threading, time, urllib.request
from fitserve.cli.main import main

port, folder, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
seen = {}

def watch():
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.02)
    healthy = time.monotonic()
    seen["gc_enabled"] = gc.isenabled()
    seen["modules"] = [m for m in ("xgrammar", "fitserve.bench", "httpx") if m in sys.modules]
    while "xgrammar" not in sys.modules and time.monotonic() - healthy < delay + 60:
        time.sleep(0.05)
    seen["xgrammar_later"] = "xgrammar" in sys.modules
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=watch, daemon=True).start()
status = main(["serve", folder, "--port", str(port), "--device", "cpu", "--max-model-len", "256"])
print(json.dumps({**seen, "status": status}))
"""


def test_a_start_answers_health_with_the_collector_on_and_no_grammar_backend(tmp_path: Path) -> None:
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = run_python(DRIVER, str(port), str(tmp_path), str(GRAMMAR_PRELOAD_DELAY_S))
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"gc_enabled": True, "modules": [], "xgrammar_later": True, "status": 0}
