"""What the planner and the speculative decoders read of a draft checkpoint before loading it: where it is
(a folder or a hub id, resolved as the target is), its weight files and tensor names (safetensors headers,
or a small `.bin` read whole), and an EAGLE-3 head's parameter count from its config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fitserve.models.decoder_blocks import head_dim_of


def resolve_draft(model: str, revision: str | None) -> tuple[str, str]:
    from fitserve.models.resolve import resolve_model

    resolved = resolve_model(model, revision, log=False)
    return resolved.model_path, resolved.source


def weight_files(path: str) -> list[Path]:
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    return files or sorted(folder.glob("pytorch_model*.bin"))


def read_keys(files: list[Path]) -> set[str]:
    """The tensor names, from the safetensors headers (a .bin checkpoint is read whole: EAGLE-3 heads are
    one small file)."""
    keys: set[str] = set()
    for file in files:
        if file.suffix == ".safetensors":
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                keys.update(k for k in json.loads(f.read(size)) if k != "__metadata__")
        else:
            keys.update(torch.load(file, map_location="cpu", weights_only=True))
    return keys


def eagle3_parameter_count(hf_config: Any, with_embedding: bool) -> int:
    """The head's weights (elements): midlayer, fc, norm, lm_head, and its embedding when it has one."""
    c = hf_config
    hidden = int(c.hidden_size)
    target_hidden = int(getattr(c, "target_hidden_size", None) or hidden)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(head_dim_of(c))
    draft_vocab = int(getattr(c, "draft_vocab_size", None) or c.vocab_size)
    attention = 2 * hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * int(c.intermediate_size)
    norms = 4 * hidden
    total = attention + mlp + norms + 3 * target_hidden * hidden + draft_vocab * hidden
    if with_embedding:
        total += int(c.vocab_size) * hidden
    return total
