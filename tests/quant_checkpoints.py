"""Tiny int4 checkpoints in every format fitserve loads, packed by this module from each format's
specification (independently of fitserve's unpacking code), for the quantization tests.

`write_quantized(folder, hf_model, spec)` round-to-nearest quantizes every decoder projection of a tiny HF
model (tests/unit/model_helpers.py) and writes config.json (with quantization_config), model.safetensors
and the SmolLM2 tokenizer files. It returns a `QuantizedCheckpoint`: the reference dequantized float32
weight of each quantized projection and the HF model with those weights, the model every loader and
kernel is compared with.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tests.model_folders import write_config_with_tokenizer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Projections fitserve fuses share their act order (one seed per fused group).
_FUSED_GROUP = {
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "o_proj": 1,
    "gate_proj": 2,
    "up_proj": 2,
    "down_proj": 3,
}


@dataclass(frozen=True)
class QuantSpec:
    fmt: str  # "gptq", "gptq_v2", "awq", "ct" (compressed-tensors pack-quantized) or "autoround"
    group_size: int = 32  # -1: per-channel
    sym: bool = True
    act_order: bool = False
    ignore: tuple[str, ...] = ()  # checkpoint module names left in float
    packed_zero_point: bool = True  # compressed-tensors asymmetric: False writes int8 [N, G] (older writers)

    @property
    def name(self) -> str:
        order = "-actorder" if self.act_order else ""
        zero = "" if self.packed_zero_point else "-int8zp"
        return f"{self.fmt}-g{self.group_size}-{'sym' if self.sym else 'asym'}{order}{zero}"


@dataclass
class RoundedWeight:
    codes: torch.Tensor  # int64 [N, K] 0..15, original column order
    scales: torch.Tensor  # float16 [N, G]
    zeros: torch.Tensor  # int64 [N, G], 0..15
    g_idx: torch.Tensor  # int64 [K]

    def dequantized(self) -> torch.Tensor:
        index = self.g_idx.unsqueeze(0).expand_as(self.codes)
        scale = self.scales.float().gather(1, index)
        zero = self.zeros.gather(1, index).float()
        return (self.codes.float() - zero) * scale


@dataclass
class QuantizedCheckpoint:
    folder: Path
    spec: QuantSpec
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # "model.layers.0.self_attn.q_proj" -> w
    dequantized_model: nn.Module | None = None


def round_to_int4(weight: torch.Tensor, spec: QuantSpec, seed: int) -> RoundedWeight:
    """Round-to-nearest int4 of `weight` [N, K]; with act order the groups are a random permutation's."""
    rows, cols = weight.shape
    group = cols if spec.group_size == -1 else spec.group_size
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed)) if spec.act_order else None
    g_idx = torch.arange(cols) // group
    if order is not None:
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[order] = torch.arange(cols) // group
    return round_to_int4_groups(weight, spec, g_idx)


def round_to_int4_groups(weight: torch.Tensor, spec: QuantSpec, g_idx: torch.Tensor) -> RoundedWeight:
    """Round-to-nearest int4 of `weight` [N, K] in the groups g_idx [K] gives each column (act order)."""
    rows, cols = weight.shape
    groups = int(g_idx.max()) + 1
    codes = torch.empty(rows, cols, dtype=torch.int64)
    scales = torch.empty(rows, groups, dtype=torch.float16)
    zeros = torch.empty(rows, groups, dtype=torch.int64)
    for g in range(groups):
        columns = (g_idx == g).nonzero().squeeze(1)
        values = weight[:, columns].float()
        if spec.sym:
            scale = (values.abs().amax(1) / 7).clamp_min(1e-6).half()
            zero = torch.full((rows,), 8, dtype=torch.int64)
        else:
            low, high = values.amin(1).clamp(max=0), values.amax(1).clamp(min=0)
            scale = ((high - low) / 15).clamp_min(1e-6).half()
            zero = (-low / scale.float()).round().clamp(0, 15).long()
        codes[:, columns] = (values / scale.float()[:, None]).round().long().add(zero[:, None]).clamp(0, 15)
        scales[:, g], zeros[:, g] = scale, zero
    return RoundedWeight(codes, scales, zeros, g_idx)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32-1 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int [A, 8 B] -> int32 [A, B]: nibble i of word c holds values[:, 8c + order[i]]."""
    grouped = values.long().view(values.shape[0], -1, 8)
    words = torch.zeros(grouped.shape[:2], dtype=torch.int64)
    for i, column in enumerate(order):
        words |= (grouped[..., column] & 0xF) << (4 * i)
    return _to_int32(words)


def pack_tensors(rounded: RoundedWeight, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one projection (suffixes after the module name), from the spec."""
    codes, zeros = rounded.codes, rounded.zeros
    if spec.fmt in ("gptq", "gptq_v2", "autoround"):
        offset = 0 if spec.fmt == "gptq_v2" else 1  # checkpoint_format gptq (v1) stores z - 1
        return {
            # qweight[i, n]: nibble j holds the code of column 8 i + j
            "qweight": pack_nibbles(
                codes.t().reshape(-1, 8, codes.shape[0]).transpose(1, 2).reshape(-1, 8 * codes.shape[0])
            ),
            "qzeros": pack_nibbles(zeros.t() - offset),
            "scales": rounded.scales.t().contiguous(),
            "g_idx": rounded.g_idx.to(torch.int32),
        }
    if spec.fmt == "awq":
        return {
            "qweight": pack_nibbles(codes.t(), AWQ_ORDER),
            "qzeros": pack_nibbles(zeros.t(), AWQ_ORDER),
            "scales": rounded.scales.t().contiguous(),
        }
    tensors = {  # compressed-tensors: signed values + 8 are the codes; zero points likewise
        "weight_packed": pack_nibbles(codes),
        "weight_scale": rounded.scales.clone(),
        "weight_shape": torch.tensor(list(codes.shape), dtype=torch.int64),
    }
    if not spec.sym and spec.packed_zero_point:
        tensors["weight_zero_point"] = pack_nibbles(zeros.t()).t().contiguous()
    elif not spec.sym:
        tensors["weight_zero_point"] = (zeros - 8).to(torch.int8)
    if spec.act_order:
        tensors["weight_g_idx"] = rounded.g_idx.to(torch.int32)
    return tensors


def quantization_config(spec: QuantSpec) -> dict[str, Any]:
    if spec.fmt in ("gptq", "gptq_v2"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": spec.group_size,
            "sym": spec.sym,
            "desc_act": spec.act_order,
            "checkpoint_format": spec.fmt,
            "modules_to_not_convert": list(spec.ignore) or None,
        }
    if spec.fmt == "autoround":
        return {
            "quant_method": "auto-round",
            "bits": 4,
            "group_size": spec.group_size,
            "sym": spec.sym,
            "data_type": "int",
            "packing_format": "auto_round:auto_gptq",
            "extra_config": {name: {"bits": 16} for name in spec.ignore},
        }
    if spec.fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": spec.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(spec.ignore) or None,
        }
    strategy = "channel" if spec.group_size == -1 else "group"
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": spec.sym,
        "strategy": strategy,
        "group_size": None if spec.group_size == -1 else spec.group_size,
        "actorder": "group" if spec.act_order else None,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head", *spec.ignore],
    }


def write_quantized(folder: Path, hf_model: nn.Module, spec: QuantSpec, seed: int = 0) -> QuantizedCheckpoint:
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()}
    checkpoint = QuantizedCheckpoint(folder, spec)
    dequantized_model = copy.deepcopy(hf_model)
    dequantized_state = dequantized_model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(state.items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS) or module in spec.ignore:
            tensors[name] = tensor.contiguous()
            continue
        # act order: the projections one fused layer packs share their input, so one g_idx (as GPTQ does)
        layer = int(module.split(".")[2])
        rounded = round_to_int4(tensor, spec, seed=seed + 10 * layer + _FUSED_GROUP[module.split(".")[-1]])
        reference = rounded.dequantized()
        checkpoint.reference[module] = reference
        with torch.no_grad():
            dequantized_state[name].copy_(reference)
        for suffix, value in pack_tensors(rounded, spec).items():
            tensors[f"{module}.{suffix}"] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = quantization_config(spec)
    write_config_with_tokenizer(folder, config)
    checkpoint.dequantized_model = dequantized_model.eval()
    return checkpoint


def write_hf_checkpoint(
    folder: Path,
    hf_model: nn.Module,
    quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
    quantizes: Callable[[str], bool],
    quantization_config: dict[str, Any] | None,
) -> tuple[nn.Module, list[str]]:
    """Writes config.json (with `quantization_config` when given), model.safetensors and the tokenizer:
    each `.weight` whose module `quantizes` stored as `quantize(module, weight)` gives it (tensors by
    suffix, and the dequantized weight), the rest as they are. Returns the HF model with the dequantized
    weights (the reference) and the modules stored quantized."""
    folder.mkdir(parents=True, exist_ok=True)
    reference = copy.deepcopy(hf_model).eval()
    reference_state = reference.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, tensor in sorted(hf_model.state_dict().items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and quantizes(module)):
            tensors[name] = tensor.detach().clone().contiguous()
            continue
        parts, dequantized = quantize(module, tensor.detach())
        with torch.no_grad():
            reference_state[name].copy_(dequantized)
        for suffix, value in parts.items():
            tensors[f"{module}{suffix}"] = value.contiguous()
        quantized.append(module)
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_model.config.to_dict()
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    write_config_with_tokenizer(folder, config)
    return reference, quantized
