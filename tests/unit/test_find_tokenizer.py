"""A model folder without a tokenizer (a config.json-only shape such as examples/models/*) is refused
before any weight loads, with the folder, what is missing and the fix; `--tokenizer` with the default
model's id works offline."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fitserve.args import EngineArgs
from fitserve.engine import engine as engine_module
from fitserve.models.default_model import DEFAULT_MODEL_ID
from fitserve.models.resolve import TOKENIZER_FILES, resolve_tokenizer_path
from fitserve.planner.resolve import create_engine_config
from tests.paths import REPO_DIR
from tests.unit.default_model_fixture import hub_off_env

SHAPE = REPO_DIR / "examples" / "models" / "qwen3-0.6b"


@pytest.fixture
def shape_only(tmp_path: Path) -> Path:
    folder = tmp_path / "qwen3-0.6b"
    folder.mkdir()
    shutil.copy(SHAPE / "config.json", folder / "config.json")
    return folder


def test_the_message_names_the_folder_what_is_missing_and_the_fix(shape_only: Path) -> None:
    with pytest.raises(ValueError) as raised:
        resolve_tokenizer_path(str(shape_only))
    message = str(raised.value)
    assert f"tokenizer folder {shape_only} has none of {', '.join(TOKENIZER_FILES)}" in message
    assert "(it holds: config.json)" in message
    assert "--tokenizer PATH_OR_ID" in message and f"--tokenizer {DEFAULT_MODEL_ID}" in message
    assert f"copy the model's tokenizer files into {shape_only}" in message


def test_a_folder_with_a_tokenizer_file_is_its_own_tokenizer(shape_only: Path) -> None:
    (shape_only / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer_path(str(shape_only)) == str(shape_only.resolve())


def test_the_engine_refuses_before_it_loads_weights(
    shape_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = create_engine_config(EngineArgs(model=str(shape_only), load_format="dummy", device="cpu"))
    started: list[object] = []
    monkeypatch.setattr(engine_module, "create_executor", lambda config: started.append(config))
    with pytest.raises(ValueError, match="has none of tokenizer.json"):
        engine_module.Engine(config)
    assert started == [], "the executor (and with it the weights) was created before the tokenizer check"


def test_bench_throughput_stops_at_once(shape_only: Path) -> None:
    """Before this check, the 0.6B model's dummy weights were built first (~10 s on 2 cores)."""
    command = [sys.executable, "-m", "fitserve", "bench", "throughput", "--model", str(shape_only)]
    command += ["--load-format", "dummy", "--input-len", "8", "--output-len", "2", "--num-prompts", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"tokenizer folder {shape_only} has none of" in result.stderr, result.stderr[-2000:]
    assert "Loading weights" not in result.stderr


@pytest.mark.network
def test_the_default_models_id_is_found_without_the_hub(
    default_model_cache, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hub_off_env(monkeypatch, default_model_cache.root, tmp_path)
    folder = resolve_tokenizer_path(DEFAULT_MODEL_ID)
    assert folder == default_model_cache.resolved.tokenizer_path
    assert (Path(folder) / "tokenizer.json").is_file()
