"""A checkpoint's config.json as a plain attribute object, for the architectures fitserve runs.

transformers' AutoConfig imports the model family's configuration module, which pulls in most of
transformers and torch._dynamo: 10.6 s on a fresh H100 machine
(benchmarks/results/h100_startup_phases_before.json), more than loading an 8B model's dummy weights.
fitserve reads a few dozen keys, so for its own architectures it reads config.json itself and fills
what the file leaves out with the defaults of the family's transformers config class
(tests/unit/test_checkpoint_config.py checks they agree). Any other architecture, or a config that
asks for remote code, still goes through AutoConfig. Gemma-4 (both forms) is read by gemma4_config.py.

The values stay as config.json writes them, except `dtype`, which becomes a torch.dtype. RoPE settings
stay in `rope_theta` and `rope_scaling` (or `rope_parameters` for files written by transformers >= 5);
the readers handle both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fitserve.models.gemma4_config import GEMMA4_ARCHITECTURES, gemma4_values
from fitserve.models.qwen3_5_config import QWEN3_5_ARCHITECTURES, qwen3_5_values

_COMMON = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        **_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "MistralForCausalLM": {
        **_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2ForCausalLM": {
        **_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "Qwen3ForCausalLM": {
        **_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
}


class CheckpointConfig:
    """config.json's keys as attributes over the family defaults. A key in neither raises
    AttributeError, so `getattr(config, key, default)` works as with a transformers config."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        dtype = values.get("dtype", values.get("torch_dtype"))  # transformers >= 4.56: `dtype`
        if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
            dtype = getattr(torch, dtype)  # a torch.dtype, as transformers' configs hold it
        if dtype is not None:
            self.dtype = dtype

    def __eq__(self, other: object) -> bool:  # two reads of one config.json are the same config
        return isinstance(other, CheckpointConfig) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like a transformers config

    @classmethod
    def from_folder(cls, folder: str | Path) -> CheckpointConfig | None:
        """The folder's config, or None when fitserve must ask transformers (another architecture,
        remote code, a composite config)."""
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # AutoConfig reports it in its own words
        if not isinstance(raw, dict) or "auto_map" in raw:
            return None
        architectures = raw.get("architectures") or []
        if len(architectures) == 1 and architectures[0] in GEMMA4_ARCHITECTURES:
            return cls(gemma4_values(raw))  # its text_config flattened (gemma4_config.py)
        if len(architectures) == 1 and architectures[0] in QWEN3_5_ARCHITECTURES:
            return cls(qwen3_5_values(raw))  # its text_config flattened (qwen3_5_config.py)
        if "text_config" in raw:
            return None
        if len(architectures) != 1 or architectures[0] not in FAMILY_DEFAULTS:
            return None
        defaults = FAMILY_DEFAULTS[architectures[0]]
        values = {**defaults, **raw}
        if "num_key_value_heads" not in values:  # Llama: no key means multi-head attention
            values["num_key_value_heads"] = values["num_attention_heads"]
        return cls(values)

    def get_text_config(self) -> CheckpointConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"CheckpointConfig({self.__dict__.get('architectures')}, hidden_size={self.hidden_size})"
