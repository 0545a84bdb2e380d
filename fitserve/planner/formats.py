"""Bytes per element of the dtypes the planner sizes, and the weight quantization methods it can plan.

A quantization method's `bits_per_weight` counts its scales and zero points, spread over the weights
they belong to. Only the decoder's projection matrices are quantized; embeddings, the LM head and
norms stay in the model dtype (vLLM's default for every method listed here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# The spellings --dtype and config.json's torch_dtype use, to the names above.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
FP8_KV_BYTES = 1
# bfloat16 needs compute capability 8.0 (Ampere); below it fp16 is the fast half-precision type.
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class QuantMethod:
    name: str
    bits_per_weight: float  # stored bits per quantized weight, scales and zero points included
    how: str  # one phrase for the user: what the method needs
    needs_quantized_checkpoint: bool  # awq / gptq: the weights must come already quantized
    min_capability: tuple[int, int]  # the oldest GPU generation vLLM runs it on


# AWQ / GPTQ: 4-bit weights in groups of 128, each group with an fp16 scale and a 4-bit zero point:
# 4 + (16 + 4) / 128 bits. bitsandbytes nf4: blocks of 64, each absmax held as float16 (fitserve's form,
# layers/quantization/bnb_sizes.py): 4 + 16 / 64 bits.
# fp8: one byte per weight; its float32 scale per output row is counted apart (memory_estimates.py).
_GROUPED_4BIT = 4 + (16 + 4) / 128
QUANTIZATION_METHODS: dict[str, QuantMethod] = {
    "fp8": QuantMethod("fp8", 8.0, "8-bit, quantized from this checkpoint while loading", False, (8, 0)),
    "awq": QuantMethod("awq", _GROUPED_4BIT, "4-bit, needs an AWQ checkpoint of the model", True, (7, 5)),
    "gptq": QuantMethod("gptq", _GROUPED_4BIT, "4-bit, needs a GPTQ checkpoint of the model", True, (6, 0)),
    "compressed-tensors": QuantMethod(
        "compressed-tensors", _GROUPED_4BIT, "4-bit, needs a W4A16 checkpoint of the model", True, (7, 5)
    ),
    "auto-round": QuantMethod(
        "auto-round", _GROUPED_4BIT, "4-bit, needs an AutoRound checkpoint of the model", True, (6, 0)
    ),
    "bitsandbytes": QuantMethod(
        "bitsandbytes", 4 + 16 / 64, "4-bit nf4, quantized from this checkpoint while loading", False, (7, 0)
    ),
}
# Names vLLM also accepts for the same storage.
QUANTIZATION_ALIASES: dict[str, str] = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "bnb": "bitsandbytes",
    "inc": "auto-round",
    "intel/auto-round": "auto-round",
}


def canonical_dtype(value: str | torch.dtype) -> str:
    """The planner's name ("bfloat16", "float16", "float32") for any spelling; ValueError if unknown."""
    text = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)
    if text not in DTYPE_ALIASES:
        raise ValueError(f"dtype={text!r} is not one of {', '.join(DTYPE_ALIASES)}: pick one of them")
    return DTYPE_ALIASES[text]


def quant_method(name: str) -> QuantMethod:
    """The method for a --quantization value; ValueError listing the ones the planner knows."""
    key = QUANTIZATION_ALIASES.get(name, name)
    if key not in QUANTIZATION_METHODS:
        known = ", ".join([*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES])
        raise ValueError(f"quantization={name!r} is not a method the planner knows: use one of {known}")
    return QUANTIZATION_METHODS[key]


def kv_cache_bytes_per_element(kv_cache_dtype: str, model_dtype: str) -> int:
    if kv_cache_dtype == "auto":
        return DTYPE_BYTES[model_dtype]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}: pick one of them"
        )
    return FP8_KV_BYTES


def format_capability(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
