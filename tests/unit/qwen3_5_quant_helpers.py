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

from pathlib import Path
from typing import Any

from torch import nn

from tests import bnb_checkpoints, fp8_checkpoints, quant_checkpoints
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.quant_helpers import (
    ProjectionCheckpoints,
    QuantizedCheckpoint,
    bnb_quantizer,
    fp8_quantizer,
    int4_quantizer,
)
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
# the decoder layers' projections
CHECKPOINTS = ProjectionCheckpoints(lambda module: module.split(".")[-1] in PROJECTIONS)
write_16bit = CHECKPOINTS.write_16bit
dequantized_reference = CHECKPOINTS.dequantized_reference


def build_model(conditional: bool, seed: int = 0, **sizes: Any) -> nn.Module:
    """The HF reference of qwen3_5_helpers (dense) with SIZES (and `sizes`) set."""
    config = make_config(moe=False, conditional=conditional)
    text = getattr(config, "text_config", config)
    for key, value in {**SIZES, **sizes}.items():
        setattr(text, key, value)
    return build_hf(config, seed=seed)


def _seed(module: str) -> int:
    layer = int(module.split("layers.")[1].split(".")[0])
    projection = module.split(".")[-1]
    return 10 * layer + _FUSED_SEED.get(projection, 2 + PROJECTIONS.index(projection))


def write_int4(folder: Path, hf_model: nn.Module, spec: QuantSpec) -> QuantizedCheckpoint:
    """An int4 checkpoint of `spec`'s format; in_proj_b / in_proj_a are in its ignore list (spec.ignore:
    full module names for compressed-tensors, as the real config lists them; fragments otherwise)."""
    return CHECKPOINTS.write(
        folder,
        hf_model,
        int4_quantizer(spec, _seed),
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


def write_fp8(folder: Path, hf_model: nn.Module, spec: Fp8Spec) -> QuantizedCheckpoint:
    """An fp8 checkpoint of `spec` (every projection, in_proj_b / in_proj_a included)."""
    config = fp8_checkpoints.quantization_config(spec)
    return CHECKPOINTS.write(folder, hf_model, fp8_quantizer(spec), lambda module: False, config)


def write_bnb(folder: Path, hf_model: nn.Module, spec: BnbSpec) -> QuantizedCheckpoint:
    """A pre-quantized bitsandbytes 4-bit checkpoint of `spec` (every projection)."""
    config = bnb_checkpoints.bnb_quantization_config(spec)
    return CHECKPOINTS.write(folder, hf_model, bnb_quantizer(spec), lambda module: False, config)
