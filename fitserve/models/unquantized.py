"""Models whose layers are plain linears in fitserve (no quantized method yet): a quantized checkpoint or
--quantization, which the loader hands the model on its config under an attribute naming quantization, is
refused, not ignored."""

from __future__ import annotations

from typing import Any


def refuse_quantization(config: Any, model_name: str) -> None:
    asked = {
        key: value
        for key, value in vars(config).items()
        if "quantization" in key.lower() and value not in (None, "", {}, "none")
    }
    if asked:
        raise ValueError(
            f"{model_name} runs unquantized in fitserve for now, but the model asks for {asked}: serve a "
            f"bfloat16 checkpoint without --quantization (quantized {model_name} layers are not implemented "
            "yet)"
        )
