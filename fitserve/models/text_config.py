"""The text model's values of a multimodal config.json (Gemma-4, Qwen3.5/3.6): the keys under
`text_config` (or at the top level of a text-only file, the towers' keys left out), with the few the
wrapper keeps for the whole checkpoint carried over, the towers it describes, and where the text model's
weights sit in the checkpoint."""

from __future__ import annotations

from typing import Any

# config.json keys a multimodal wrapper holds for the whole checkpoint, which win over the text_config's.
WRAPPER_KEYS = (
    "architectures",
    "dtype",
    "torch_dtype",
    "eos_token_id",
    "tie_word_embeddings",
    "quantization_config",
)


def text_values(raw: dict[str, Any], defaults: dict[str, Any], tower_keys: tuple[str, ...]) -> dict[str, Any]:
    """`defaults` overlaid with the text model's keys and the wrapper's WRAPPER_KEYS; `towers` names the
    towers of `tower_keys` the file describes ("vision_config" -> "vision"), `weights_prefix` where the
    text model's tensors sit ("model.language_model." under a text_config, else "model.")."""
    text = raw.get("text_config")
    nested = isinstance(text, dict)
    source = text if nested else {key: value for key, value in raw.items() if key not in tower_keys}
    values = {**defaults, **source}
    for key in WRAPPER_KEYS:
        if key in raw:
            values[key] = raw[key]
    values["towers"] = [key.removesuffix("_config") for key in tower_keys if raw.get(key)]
    values["weights_prefix"] = "model.language_model." if nested else "model."
    return values
