"""Model folders for tests: a config (or a whole checkpoint) with SmolLM2's tokenizer files beside it, so
that fitserve (or transformers) can open the folder as a model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.paths import SMOLLM2_TOKENIZER_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def copy_smollm2_tokenizer(folder: Path, chat_template: bool = False) -> Path:
    """Copies SmolLM2's tokenizer.json and tokenizer_config.json (and its chat_template.jinja with
    `chat_template`) into the existing `folder`; returns `folder`."""
    names = (*TOKENIZER_FILES, CHAT_TEMPLATE_FILE) if chat_template else TOKENIZER_FILES
    for name in names:
        shutil.copy(SMOLLM2_TOKENIZER_DIR / name, folder / name)
    return folder


def save_with_tokenizer(saved: Any, folder: Path) -> Path:
    """`saved` (an HF model, or a config alone) written by its own save_pretrained into `folder`, with
    SmolLM2's tokenizer beside it; returns `folder`."""
    saved.save_pretrained(folder)
    return copy_smollm2_tokenizer(folder)


def write_config_with_tokenizer(folder: Path, config: dict[str, Any], indent: int | None = 1) -> Path:
    """`config` written as `folder`/config.json (json.dumps with `indent`), with SmolLM2's tokenizer beside
    it; makes `folder` if it is missing and returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=indent))
    return copy_smollm2_tokenizer(folder)
