"""Tiny random Qwen3.5 models quantized into each checkpoint format fitserve loads, for the quantized
Qwen3.5 tests: every linear of the decoder layers (full attention, Gated DeltaNet, MLP) rounded by the
formats' writers in tests/quant_checkpoints.py, tests/fp8_checkpoints.py and tests/bnb_checkpoints.py
(independent of fitserve's loaders), with the HF reference model holding the dequantized weights.

The model is qwen3_5_helpers' with sizes every format packs: hidden 64, MLP 64, value heads of 16 dims (so
each quantized layer's input is a multiple of the int4 group of 16 and of a bitsandbytes block of 64, on
one rank and on each of two). in_proj_b and in_proj_a (4 rows, too few for int4's 8-row packing) stay in
16 bits through the checkpoint's ignore list, as the published Qwen3.6-27B AWQ-INT4 leaves them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests import bnb_checkpoints, fp8_checkpoints, quant_checkpoints
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.qwen3_5_helpers import build_hf, make_config

SIZES = {"hidden_size": 64, "intermediate_size": 64, "linear_value_head_dim": 16}
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
SMALL = ("in_proj_b", "in_proj_a")  # left in 16 bits by int4 checkpoints
# projections fitserve fuses share one act order (one seed each group)
_FUSED_SEED = {"gate_proj": 1, "up_proj": 1}

# (tensors by suffix after the module name, the dequantized float32 weight)
Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


@dataclass
class QuantizedQwen:
    folder: Path
    reference: nn.Module  # the HF model with every quantized projection's dequantized weight
    quantized: list[str]  # checkpoint module names stored quantized


def build_model(conditional: bool, seed: int = 0, **sizes: Any) -> nn.Module:
    """The HF reference of qwen3_5_helpers (dense) with SIZES (and `sizes`) set."""
    config = make_config(moe=False, conditional=conditional)
    text = getattr(config, "text_config", config)
    for key, value in {**SIZES, **sizes}.items():
        setattr(text, key, value)
    return build_hf(config, seed=seed)


def write_checkpoint(
    folder: Path,
    hf_model: nn.Module,
    quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
    skip: Callable[[str], bool],
    quantization_config: dict[str, Any] | None,
) -> QuantizedQwen:
    """Writes config.json (with `quantization_config`), model.safetensors and the tokenizer: each decoder
    projection not `skip`ped stored as `quantize(module, weight)` gives it."""
    reference, quantized = quant_checkpoints.write_hf_checkpoint(
        folder,
        hf_model,
        quantize,
        lambda module: module.split(".")[-1] in PROJECTIONS and not skip(module),
        quantization_config,
    )
    return QuantizedQwen(folder, reference, quantized)


def _layer(module: str) -> int:
    return int(module.split("layers.")[1].split(".")[0])


def write_int4(folder: Path, hf_model: nn.Module, spec: QuantSpec) -> QuantizedQwen:
    """An int4 checkpoint of `spec`'s format; in_proj_b / in_proj_a are in its ignore list (spec.ignore:
    full module names for compressed-tensors, as the real config lists them; fragments otherwise)."""

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        projection = module.split(".")[-1]
        seed = 10 * _layer(module) + _FUSED_SEED.get(projection, 2 + PROJECTIONS.index(projection))
        rounded = quant_checkpoints.round_to_int4(weight, spec, seed=seed)
        parts = quant_checkpoints.pack_tensors(rounded, spec)
        return {f".{suffix}": value for suffix, value in parts.items()}, rounded.dequantized()

    return write_checkpoint(
        folder,
        hf_model,
        quantize,
        lambda module: module.split(".")[-1] in SMALL or module in spec.ignore,
        quant_checkpoints.quantization_config(spec),
    )


def int4_ignore(spec_fmt: str, hf_model: nn.Module) -> tuple[str, ...]:
    """The ignore list naming in_proj_b / in_proj_a: every DeltaNet layer's by full checkpoint name for
    compressed-tensors (as the Qwen3.6-27B AWQ-INT4 config does), the name fragments for the others."""
    if spec_fmt != "ct":
        return SMALL
    names = [name.removesuffix(".weight") for name in hf_model.state_dict()]
    return tuple(name for name in names if name.split(".")[-1] in SMALL)


def write_fp8(folder: Path, hf_model: nn.Module, spec: Fp8Spec) -> QuantizedQwen:
    """An fp8 checkpoint of `spec` (every projection, in_proj_b / in_proj_a included)."""
    scale_name = "weight_scale_inv" if spec.fmt == "hf" and spec.strategy == "block" else "weight_scale"

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        data, scale, dequantized = fp8_checkpoints.quantize(weight, spec)
        parts = {".weight": data, f".{scale_name}": scale.float()}
        if spec.activations == "static":  # a calibrated per-tensor activation scale: any positive value
            parts[".input_scale"] = torch.full((1,) if spec.fmt == "ct" else (), 0.02)
        return parts, dequantized

    return write_checkpoint(
        folder, hf_model, quantize, lambda module: False, fp8_checkpoints.quantization_config(spec)
    )


def write_bnb(folder: Path, hf_model: nn.Module, spec: BnbSpec) -> QuantizedQwen:
    """A pre-quantized bitsandbytes 4-bit checkpoint of `spec` (every projection)."""

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        parts, dequantized = bnb_checkpoints.quantize_spec(weight, spec)
        return {f".weight{suffix}": value for suffix, value in parts.items()}, dequantized

    return write_checkpoint(
        folder, hf_model, quantize, lambda module: False, bnb_checkpoints.bnb_quantization_config(spec)
    )


def write_16bit(folder: Path, hf_model: nn.Module) -> Path:
    """The model as a plain float32 checkpoint (for --quantization fp8 / bitsandbytes)."""
    write_checkpoint(folder, hf_model, lambda module, weight: ({}, weight), lambda module: True, None)
    return folder


def dequantized_reference(
    hf_model: nn.Module, dequantize: Callable[[torch.Tensor], torch.Tensor]
) -> nn.Module:
    """The HF model with every decoder projection replaced by `dequantize(weight)` (what quantizing while
    loading gives it)."""
    reference = copy.deepcopy(hf_model).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(".weight") and name.removesuffix(".weight").split(".")[-1] in PROJECTIONS:
                param.copy_(dequantize(param.detach()))
    return reference
