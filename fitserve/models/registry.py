"""HF architecture name (config.architectures[0]) -> model class, imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("fitserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("fitserve.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("fitserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("fitserve.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("fitserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma4ForCausalLM": ("fitserve.models.gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("fitserve.models.gemma4", "Gemma4ForConditionalGeneration"),
    "Qwen3_5ForCausalLM": ("fitserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("fitserve.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForCausalLM": ("fitserve.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("fitserve.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(
            "the model's config.json has no 'architectures' entry: add one of "
            f"{supported_architectures()} to it"
        )
    architecture = architectures[0]
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported: fitserve runs {supported_architectures()}"
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
