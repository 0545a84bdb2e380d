"""Tiny bitsandbytes 4-bit checkpoints in the layout transformers' save_pretrained writes for a
load_in_4bit model, for the bitsandbytes tests.

The tensors are quantized by this module from the format's specification, independently of fitserve's
code: per block of `blocksize` consecutive elements of the row-major weight, absmax = max |w|, and each
element the nearest code of w / absmax (the nf4 / fp4 tables below); two codes a byte, the even element
in the high nibble. Double quant: the absmax values (minus their mean, stored as nested_offset) in blocks
of 256, each block scaled by its largest magnitude and rounded to the nearest of a 256-entry signed table
(nested_quant_map; bitsandbytes writes its "dynamic" table, any table decodes the same way). With
`use_bitsandbytes` the bitsandbytes package itself (functional.quantize_4bit, compress_statistics for
double quant) writes the tensors instead.

`write_bnb(folder, hf_model, spec)` returns a tests.quant_checkpoints.QuantizedCheckpoint: the float32
dequantized weight of each quantized projection and the HF model holding them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tests.model_folders import write_config_with_tokenizer
from tests.quant_checkpoints import PROJECTIONS, QuantizedCheckpoint

NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
    1.0,
]  # fmt: skip
# fp4: sign bit 3; magnitudes in units of 1/12: 0, 1/16, 8, 12, 4, 6, 2, 3
FP4 = [m / 12 for m in (0, 0.0625, 8, 12, 4, 6, 2, 3)] + [-m / 12 for m in (0, 0.0625, 8, 12, 4, 6, 2, 3)]
NESTED_BLOCK = 256


@dataclass(frozen=True)
class BnbSpec:
    quant_type: str = "nf4"
    double_quant: bool = False
    blocksize: int = 64
    skip: tuple[str, ...] = ()  # llm_int8_skip_modules (module name fragments left 16-bit)
    use_bitsandbytes: bool = False
    # The reference with each block's absmax rounded to float16, as fitserve holds it (greedy comparisons,
    # where a near-tie of a tiny random model can flip on that rounding).
    reference_fp16_absmax: bool = False

    @property
    def name(self) -> str:
        tool = "-bnblib" if self.use_bitsandbytes else ""
        return f"{self.quant_type}-b{self.blocksize}{'-dq' if self.double_quant else ''}{tool}"


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return (values.unsqueeze(-1) - table).abs().argmin(dim=-1)


def quantize_spec(weight: torch.Tensor, spec: BnbSpec) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the projection's tensors by suffix after `.weight`, its float32 dequantized weight)."""
    if spec.use_bitsandbytes:
        return _quantize_with_bitsandbytes(weight, spec)
    table = torch.tensor(NF4 if spec.quant_type == "nf4" else FP4)
    flat = weight.float().reshape(-1, spec.blocksize)
    absmax = flat.abs().amax(dim=1)
    codes = _nearest(flat / absmax.clamp_min(1e-12)[:, None], table).reshape(-1)
    tensors: dict[str, torch.Tensor] = {
        "": ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).unsqueeze(1),
        ".quant_map": table.clone(),
    }
    state: dict[str, Any] = {
        "quant_type": spec.quant_type,
        "blocksize": spec.blocksize,
        "dtype": "bfloat16",
        "shape": list(weight.shape),
    }
    if spec.double_quant:
        offset = absmax.mean().item()
        centered = absmax - offset
        blocks = torch.nn.functional.pad(centered, (0, -len(centered) % NESTED_BLOCK)).view(-1, NESTED_BLOCK)
        nested_absmax = blocks.abs().amax(dim=1).clamp_min(1e-12)
        nested_table = torch.linspace(-1, 1, 256)
        index = _nearest(blocks / nested_absmax[:, None], nested_table).reshape(-1)[: len(absmax)]
        absmax = nested_table[index] * nested_absmax.repeat_interleave(NESTED_BLOCK)[: len(absmax)] + offset
        tensors[".absmax"] = index.to(torch.uint8)
        tensors[".nested_absmax"] = nested_absmax
        tensors[".nested_quant_map"] = nested_table
        state.update(nested_blocksize=NESTED_BLOCK, nested_dtype="float32", nested_offset=offset)
    else:
        tensors[".absmax"] = absmax
    key = f".quant_state.bitsandbytes__{spec.quant_type}"
    tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    scale = absmax.half().float() if spec.reference_fp16_absmax else absmax
    dequantized = (table[codes].view(-1, spec.blocksize) * scale[:, None]).view(weight.shape)
    return tensors, dequantized


def _quantize_with_bitsandbytes(
    weight: torch.Tensor, spec: BnbSpec
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from bitsandbytes import functional

    packed, state = functional.quantize_4bit(
        weight.float(),  # float32: dequantize_4bit then returns the float32 reference
        blocksize=spec.blocksize,
        quant_type=spec.quant_type,
        compress_statistics=spec.double_quant,
    )
    tensors = {"": packed}
    for key, value in state.as_dict(packed=True).items():
        tensors["." + key] = value
    return tensors, functional.dequantize_4bit(packed, state).float()


def bnb_quantization_config(spec: BnbSpec) -> dict[str, Any]:
    """What transformers' BitsAndBytesConfig.to_dict() writes for load_in_4bit."""
    return {
        "quant_method": "bitsandbytes",
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": spec.quant_type,
        "bnb_4bit_use_double_quant": spec.double_quant,
        "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": list(spec.skip) or None,
        "llm_int8_threshold": 6.0,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_enable_fp32_cpu_offload": False,
    }


def write_bnb(folder: Path, hf_model: nn.Module, spec: BnbSpec) -> QuantizedCheckpoint:
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = QuantizedCheckpoint(folder, spec)  # type: ignore[arg-type]
    dequantized_model = copy.deepcopy(hf_model)
    dequantized_state = dequantized_model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(hf_model.state_dict().items()):
        module = name.removesuffix(".weight")
        quantized = name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS
        if not quantized or any(fragment in module for fragment in spec.skip):
            tensors[name] = tensor.detach().contiguous()
            continue
        parts, reference = quantize_spec(tensor.detach(), spec)
        checkpoint.reference[module] = reference
        with torch.no_grad():
            dequantized_state[name].copy_(reference)
        for suffix, value in parts.items():
            tensors[f"{name}{suffix}"] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = bnb_quantization_config(spec)
    write_config_with_tokenizer(folder, config)
    checkpoint.dequantized_model = dequantized_model.eval()
    return checkpoint
