"""Tiny fp8 checkpoints in every fp8 format fitserve loads, written by this module from each format's
specification (independently of fitserve's loading code), for the fp8 tests.

- "ct": compressed-tensors float-quantized (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): `weight`
  float8_e4m3fn, `weight_scale` float32 [1] (tensor), [N, 1] (channel) or [ceil(N/bn), ceil(K/bk)] (block),
  `input_scale` [1] for static activations.
- "hf": quant_method fp8 (HF / vLLM fp8): `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] with
  weight_block_size, else a per-tensor `weight_scale` []; `input_scale` [] for activation_scheme static.

`write_fp8(folder, hf_model, spec)` quantizes every decoder projection of a tiny HF model
(tests/unit/model_helpers.py) round-to-nearest (amax / 448 per tensor, row or block) and writes
config.json, model.safetensors and the SmolLM2 tokenizer files; it returns the reference dequantized
float32 weights and the HF model holding them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tests.model_folders import write_config_with_tokenizer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Spec:
    fmt: str  # "ct" or "hf"
    strategy: str = "channel"  # "tensor", "channel" or "block"
    activations: str = "dynamic"  # "dynamic", "static" or "none" (weight-only; ct only)
    block: tuple[int, int] = (32, 32)
    ignore: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        block = f"{self.block[0]}x{self.block[1]}" if self.strategy == "block" else ""
        return f"{self.fmt}-{self.strategy}{block}-{self.activations}" + ("-ignore" if self.ignore else "")


@dataclass
class Fp8Checkpoint:
    folder: Path
    spec: Fp8Spec
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # module name -> float32 weight
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # what model.safetensors holds
    dequantized_model: nn.Module | None = None


def quantize(weight: torch.Tensor, spec: Fp8Spec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], the scale as the checkpoint stores it, dequantized float32 [N, K])."""
    w = weight.float()
    rows, cols = w.shape
    if spec.strategy == "tensor":
        scale = (w.abs().max() / E4M3_MAX).reshape(1)
        full = scale.expand(rows, cols)
    elif spec.strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
        full = scale.expand(rows, cols)
    else:
        bn, bk = spec.block
        blocks_n, blocks_k = -(-rows // bn), -(-cols // bk)
        scale = torch.empty(blocks_n, blocks_k)
        for i in range(blocks_n):
            for j in range(blocks_k):
                block = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                scale[i, j] = (block.abs().max() / E4M3_MAX).clamp_min(1e-12)
        full = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    data = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    if spec.fmt == "hf" and spec.strategy == "tensor":
        scale = scale.reshape(())
    return data, scale, data.float() * full


def quantization_config(spec: Fp8Spec) -> dict[str, Any]:
    if spec.fmt == "hf":
        config: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": spec.activations,
            "modules_to_not_convert": ["lm_head", *spec.ignore],
        }
        if spec.strategy == "block":
            config["weight_block_size"] = list(spec.block)
        return config
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": spec.strategy,
        "dynamic": False,
        "block_structure": list(spec.block) if spec.strategy == "block" else None,
    }
    acts = None
    if spec.activations != "none":
        dynamic = spec.activations == "dynamic"
        strategy = ("group" if spec.strategy == "block" else "token") if dynamic else "tensor"
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
        if strategy == "group":
            acts["group_size"] = spec.block[1]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head", *spec.ignore],
    }


def write_fp8(folder: Path, hf_model: nn.Module, spec: Fp8Spec, seed: int = 0) -> Fp8Checkpoint:
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    checkpoint = Fp8Checkpoint(folder, spec)
    dequantized_model = copy.deepcopy(hf_model)
    dequantized_state = dequantized_model.state_dict()
    scale_name = "weight_scale_inv" if spec.fmt == "hf" and spec.strategy == "block" else "weight_scale"
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(hf_model.state_dict().items()):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS) or module in spec.ignore:
            tensors[name] = tensor.detach().clone().contiguous()
            continue
        data, scale, reference = quantize(tensor, spec)
        checkpoint.reference[module] = reference
        with torch.no_grad():
            dequantized_state[name].copy_(reference)
        tensors[name] = data.contiguous()
        tensors[f"{module}.{scale_name}"] = scale.float().contiguous()
        if spec.activations == "static":  # a calibrated per-tensor activation scale: any positive value
            value = 0.01 + 0.02 * torch.rand((), generator=generator)
            tensors[f"{module}.input_scale"] = value.reshape(1 if spec.fmt == "ct" else ())
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = quantization_config(spec)
    write_config_with_tokenizer(folder, config)
    checkpoint.tensors = tensors
    checkpoint.dequantized_model = dequantized_model.eval()
    return checkpoint


def write_bf16(folder: Path, hf_model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The HF model as a plain 16-bit checkpoint (for --quantization fp8)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in hf_model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_config_with_tokenizer(folder, config)
    return folder
