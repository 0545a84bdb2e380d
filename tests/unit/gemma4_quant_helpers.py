"""Tiny random Gemma-4 models quantized into the checkpoint formats fitserve loads, for the quantized
Gemma-4 tests: every linear outside the MoE experts (attention, dense MLP, the E models' per-layer input
gate, projection and model projection) rounded by the formats' writers in tests/quant_checkpoints.py,
tests/fp8_checkpoints.py and tests/bnb_checkpoints.py (independent of fitserve's loaders), with the HF
reference model holding the dequantized weights.

The models are gemma4_helpers' cases at sizes int4 group 32 packs on one rank and on each of two: MLP
64 (32 a rank), per-layer inputs of 32, attention outputs of 64 and 128. The MoE router's projection (6
rows: too few for int4's 8-row packing) and the experts stay 16-bit through the checkpoint's ignore list,
as the published checkpoints keep them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from fitserve.layers.attention.metadata import forward_context
from tests import bnb_checkpoints, fp8_checkpoints, quant_checkpoints
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.gemma4_helpers import BASE, CASES, F, S, build_hf, conditional_config
from tests.unit.quant_helpers import (
    ProjectionCheckpoints,
    QuantizedCheckpoint,
    bnb_quantizer,
    fp8_quantizer,
    int4_quantizer,
)

SIZES = {"intermediate_size": 64, "hidden_size_per_layer_input": 32}
GROUP = 32
# A dense 31B-like model: no per-layer inputs, full layers K=V with 2 KV heads of 32 (split at TP 2).
DENSE = {
    "num_hidden_layers": 4,
    "layer_types": [S, F, S, F],
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 2,
}
ALL_CASES = {**CASES, "dense": DENSE}
PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
    "proj",  # the router's
)
# left 16-bit by every int4 checkpoint: the router (6 rows) and the experts (3-D tensors)
ROUTER_AND_EXPERTS = ("router", "experts")
TOKENS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
_SEEDS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "gate_proj": 2, "up_proj": 2}  # fused: one act order


def build_model(case: str, conditional: bool = False, seed: int = 0, **sizes: Any) -> nn.Module:
    """HF's model of the case (ALL_CASES) with SIZES (and `sizes`) set; the ConditionalGeneration form
    (weights under model.language_model.) when `conditional`."""
    values = {**BASE, **ALL_CASES[case], "intermediate_size": SIZES["intermediate_size"]}
    if values["hidden_size_per_layer_input"]:
        values["hidden_size_per_layer_input"] = SIZES["hidden_size_per_layer_input"]
    text = transformers.Gemma4TextConfig(architectures=["Gemma4ForCausalLM"], **{**values, **sizes})
    if not conditional:
        return build_hf(text, seed=seed)
    towers = conditional_config("e_model")
    config = transformers.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=towers.vision_config.to_dict(),
        audio_config=towers.audio_config.to_dict(),
        architectures=["Gemma4ForConditionalGeneration"],
    )
    return build_hf(config, seed=seed)


# the text model's projections (the vision and audio towers' linears stay as they are)
CHECKPOINTS = ProjectionCheckpoints(
    lambda module: module.split(".")[-1] in PROJECTIONS and "tower" not in module
)
write_16bit = CHECKPOINTS.write_16bit
dequantized_reference = CHECKPOINTS.dequantized_reference


def _seed(module: str) -> int:
    layer = int(module.split("layers.")[1].split(".")[0]) if "layers." in module else 99
    name = module.split(".")[-1]
    return 20 * layer + _SEEDS.get(name, 3 + PROJECTIONS.index(name))


def int4_ignore(fmt: str) -> tuple[str, ...]:
    """The ignore list keeping the router and experts 16-bit: compressed-tensors' regexes (as
    llm-compressor recipes write them), name fragments for the others."""
    if fmt == "ct":
        return ("re:.*router.*", "re:.*experts.*")
    return ROUTER_AND_EXPERTS


def write_int4(folder: Path, hf_model: nn.Module, spec: QuantSpec) -> QuantizedCheckpoint:
    """An int4 checkpoint of `spec`'s format; the router, the experts and the modules spec.ignore names in
    full stay 16-bit (spec.ignore should also hold int4_ignore's entries, which the config lists)."""

    def skip(module: str) -> bool:  # the ignore list as the writer applies it (independent of fitserve)
        return module in spec.ignore or any(f".{part}." in module for part in ROUTER_AND_EXPERTS)

    config = quant_checkpoints.quantization_config(spec)
    return CHECKPOINTS.write(folder, hf_model, int4_quantizer(spec, _seed), skip, config)


def write_fp8(folder: Path, hf_model: nn.Module, spec: Fp8Spec) -> QuantizedCheckpoint:
    """An fp8 checkpoint of `spec`: every projection but the router's (and the experts)."""
    config = fp8_checkpoints.quantization_config(spec)
    if spec.fmt == "ct":
        config["ignore"] = [*config["ignore"], "re:.*router.*", "re:.*experts.*"]
    else:
        config["modules_to_not_convert"] = [*config["modules_to_not_convert"], *ROUTER_AND_EXPERTS]
    return CHECKPOINTS.write(folder, hf_model, fp8_quantizer(spec), _is_router, config)


def write_bnb(folder: Path, hf_model: nn.Module, spec: BnbSpec) -> QuantizedCheckpoint:
    """A pre-quantized bitsandbytes 4-bit checkpoint of `spec` (every projection but the router's)."""
    config = bnb_checkpoints.bnb_quantization_config(spec)
    return CHECKPOINTS.write(folder, hf_model, bnb_quantizer(spec), _is_router, config)


def _is_router(module: str) -> bool:
    return ".router." in module


def logits_of(model: nn.Module, tokens: list[int] = TOKENS) -> torch.Tensor | None:
    """One whole-sequence forward without a cache (None off rank 0 under tensor parallel)."""
    with torch.no_grad(), forward_context(None, []):
        logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
    return None if logits is None else logits.float()


def hf_logits(reference: nn.Module, tokens: list[int] = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=torch.tensor([tokens])).logits[0].float()
