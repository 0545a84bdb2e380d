"""The linear method of each layer, picked by the type of the checkpoint's format (quant_config.py's
`quant_format`): Int4Format -> Int4LinearMethod, Fp8Format -> Fp8LinearMethod. A new format adds one
entry to `method_class` (and its sizes to `stored_from_config`)."""

from __future__ import annotations

from typing import Any

from fitserve.layers.quantization.fp8_format import Fp8Format


def method_class(fmt: Any) -> type:
    from fitserve.layers.quantization.bnb_format import BnbFormat
    from fitserve.layers.quantization.bnb_method import BnbLinearMethod
    from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
    from fitserve.layers.quantization.int4_method import Int4LinearMethod
    from fitserve.layers.quantization.quant_config import Int4Format

    classes: dict[type, type] = {
        Int4Format: Int4LinearMethod,
        Fp8Format: Fp8LinearMethod,
        BnbFormat: BnbLinearMethod,
    }
    for kind, cls in classes.items():
        if isinstance(fmt, kind):
            return cls
    raise TypeError(f"no linear method for the quantized format {type(fmt).__name__}")


def stored_from_config(fmt: Any, hf_config: Any) -> tuple[int, int] | None:
    """(parameters the format's quantized projections hold, their bytes as fitserve holds them) from
    config.json's shapes (a folder without weight files); None for a config not sized (MoE)."""
    from fitserve.layers.quantization.bnb_format import BnbFormat
    from fitserve.layers.quantization.bnb_sizes import stored_bnb_from_config
    from fitserve.layers.quantization.fp8_shapes import stored_fp8_from_config
    from fitserve.layers.quantization.int4_formats import stored_int4_from_config

    if isinstance(fmt, Fp8Format):
        return stored_fp8_from_config(fmt, hf_config)
    if isinstance(fmt, BnbFormat):
        return stored_bnb_from_config(fmt, hf_config)
    return stored_int4_from_config(fmt, hf_config)


def linear_method_for(fmt: Any, layer_name: str, modules: list[str]) -> Any:
    """The method for the layer `layer_name` made of the checkpoint's linear `modules` (one, or the
    projections a fused layer packs): the format's when the checkpoint quantizes them, None (unquantized)
    when it leaves them out; ValueError when it quantizes some of a fused layer's projections only."""
    if fmt is None:
        return None
    quantized = [fmt.quantizes(module) for module in modules]
    if all(quantized):
        return method_class(fmt)(fmt, layer_name)
    if not any(quantized):
        return None
    kept = [module for module, flag in zip(modules, quantized, strict=True) if not flag]
    raise ValueError(
        f"{fmt.method} checkpoint leaves {', '.join(kept)} unquantized but quantizes the other projections "
        f"fused into {layer_name}: fitserve fuses them into one layer; quantize all of them or none"
    )
