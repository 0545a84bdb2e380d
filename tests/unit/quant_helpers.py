"""Shared by the quantized-checkpoint tests: the greedy comparison of fitserve's whole engine against HF
transformers on tiny Llama / Qwen3 models (test_quant_{fp8,int4,bnb}_engine.py), fitserve's model of a
checkpoint folder loaded without the engine (the Gemma-4 and Qwen3.5 quantized logits tests), the
writing of a model family's projections in each quantized format (gemma4_quant_helpers.py,
qwen3_5_quant_helpers.py), and the refusals' checkpoint edits (test_quant_{fp8,int4}_refusals.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fitserve import LLM, SamplingParams
from fitserve.args import EngineArgs
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.planner.resolve import plan_settings
from tests import bnb_checkpoints, fp8_checkpoints, quant_checkpoints
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.model_helpers import build_fitserve_model
from tests.unit.test_engine_vs_hf import hf_greedy

# tiny_hf_config overrides of the three engine tests: each projection's input 128 or 256 wide
DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77))]
NEW_TOKENS = 10


def greedy_hf(model: torch.nn.Module) -> list[list[int]]:
    """HF transformers' NEW_TOKENS greedy tokens after each of PROMPTS (the reference)."""
    return [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def fitserve_llm(folder: Path, **kwargs) -> LLM:
    """fitserve's engine on the CPU in float32 for the folder (`kwargs`: quantization, load_format, ...)."""
    return LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=8, **kwargs)


def greedy_fitserve(llm: LLM) -> list[list[int]]:
    """The engine's NEW_TOKENS greedy tokens after each of PROMPTS."""
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def model_of(llm: LLM) -> torch.nn.Module:
    """The model the engine runs."""
    return llm.engine.executor.runner.model


def load_model(folder: Path, flag: str | None = None) -> torch.nn.Module:
    """fitserve's model of the folder's checkpoint (`flag`: --quantization), every parameter loaded, on this
    process's tensor-parallel rank."""
    config = with_quantization_flag(CheckpointConfig.from_folder(folder), flag)
    return build_fitserve_model(config, load_file(folder / "model.safetensors"))


# --- a model family's projections written in each format (the Gemma-4 and Qwen3.5 quantized tests) ---

# (module name, float32 weight) -> (the tensors stored for it by suffix after the module name, the
# dequantized float32 weight the HF reference gets)
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


@dataclass
class QuantizedCheckpoint:
    folder: Path
    reference: nn.Module  # the HF model with every quantized projection's dequantized weight
    quantized: list[str]  # checkpoint module names stored quantized


def int4_quantizer(spec: QuantSpec, seed_of: Callable[[str], int]) -> Quantizer:
    """Round-to-nearest int4 of `spec`, packed as its format stores it; `seed_of(module)` seeds the act
    order (projections fitserve fuses must share one)."""

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rounded = quant_checkpoints.round_to_int4(weight, spec, seed=seed_of(module))
        parts = quant_checkpoints.pack_tensors(rounded, spec)
        return {f".{suffix}": value for suffix, value in parts.items()}, rounded.dequantized()

    return quantize


def fp8_quantizer(spec: Fp8Spec) -> Quantizer:
    """fp8 of `spec`: the weight and its scale, and with static activations an input scale."""
    scale_name = "weight_scale_inv" if spec.fmt == "hf" and spec.strategy == "block" else "weight_scale"

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        data, scale, dequantized = fp8_checkpoints.quantize(weight, spec)
        parts = {".weight": data, f".{scale_name}": scale.float()}
        if spec.activations == "static":  # a calibrated per-tensor activation scale: any positive value
            parts[".input_scale"] = torch.full((1,) if spec.fmt == "ct" else (), 0.02)
        return parts, dequantized

    return quantize


def bnb_quantizer(spec: BnbSpec) -> Quantizer:
    """A pre-quantized bitsandbytes 4-bit weight of `spec` and its quant state tensors."""

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        parts, dequantized = bnb_checkpoints.quantize_spec(weight, spec)
        return {f".weight{suffix}": value for suffix, value in parts.items()}, dequantized

    return quantize


@dataclass(frozen=True)
class ProjectionCheckpoints:
    """Checkpoints of a model family whose quantizable linears are the modules `is_projection` names."""

    is_projection: Callable[[str], bool]

    def write(
        self,
        folder: Path,
        hf_model: nn.Module,
        quantize: Quantizer,
        skip: Callable[[str], bool],
        quantization_config: dict[str, Any] | None,
    ) -> QuantizedCheckpoint:
        """Writes config.json (with `quantization_config`), model.safetensors and the tokenizer: each
        projection not `skip`ped stored as `quantize(module, weight)` gives it."""
        reference, quantized = quant_checkpoints.write_hf_checkpoint(
            folder,
            hf_model,
            quantize,
            lambda module: self.is_projection(module) and not skip(module),
            quantization_config,
        )
        return QuantizedCheckpoint(folder, reference, quantized)

    def write_16bit(self, folder: Path, hf_model: nn.Module) -> Path:
        """The model as a plain float32 checkpoint (for --quantization fp8 / bitsandbytes)."""
        self.write(folder, hf_model, lambda module, weight: ({}, weight), lambda module: True, None)
        return folder

    def dequantized_reference(
        self, hf_model: nn.Module, dequantize: Callable[[torch.Tensor], torch.Tensor]
    ) -> nn.Module:
        """The HF model with every projection replaced by `dequantize(weight)` (what quantizing while
        loading gives it)."""
        reference = copy.deepcopy(hf_model).eval()
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith(".weight") and self.is_projection(name.removesuffix(".weight")):
                    param.copy_(dequantize(param.detach()))
        return reference


# --- refusals: a checkpoint folder with one thing changed (test_quant_{fp8,int4}_refusals.py) ---


def with_quant_config(folder: Path, tmp_path: Path, quant: dict | None) -> Path:
    """A copy of `folder` whose config.json has `quant` as its quantization_config (None: removed)."""
    copy_folder = tmp_path / "model"
    copy_folder.mkdir()
    for item in folder.iterdir():
        if item.name != "config.json":
            (copy_folder / item.name).symlink_to(item)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    if quant is not None:
        config["quantization_config"] = quant
    (copy_folder / "config.json").write_text(json.dumps(config))
    return copy_folder


def refusal(folder: Path, **kwargs) -> str:
    """The message of the ValueError plan_settings raises for the folder (`kwargs`: more EngineArgs)."""
    with pytest.raises(ValueError) as error:
        plan_settings(EngineArgs(model=str(folder), device="cpu", **kwargs))
    return str(error.value)


def rewrite_tensor(
    folder: Path, tmp_path: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]
) -> Path:
    """A copy of `folder` whose tensor `name` is `change(tensor)`."""
    copy_folder = with_quant_config(
        folder, tmp_path, json.loads((folder / "config.json").read_text())["quantization_config"]
    )
    (copy_folder / "model.safetensors").unlink()
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(copy_folder / "model.safetensors"))
    return copy_folder


def load_weights(folder: Path) -> None:
    """Builds the folder's model and loads its weights as the model loader does (raising what it raises)."""
    from fitserve.models.loader import load_hf_config
    from fitserve.models.registry import get_model_class
    from fitserve.models.weights import iterate_safetensors, list_safetensors_files

    config = load_hf_config(str(folder))
    get_model_class(config)(config).load_weights(iterate_safetensors(list_safetensors_files(str(folder))))


def quantized_expert_tensors(
    name: str, fused: torch.Tensor, quantize: Quantizer
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A fused expert tensor of transformers' form (`...mlp.experts.gate_up_proj` [E, 2I, H] or `down_proj`
    [E, H, I]) as a quantized checkpoint stores it, one tensor set per expert and projection
    (`...mlp.experts.<e>.<gate|up|down>_proj.<suffix>`), and its dequantized values (the reference's)."""
    base = name.rsplit(".", 1)[0]
    width = fused.shape[1] // 2
    parts = {"gate_proj": slice(0, width), "up_proj": slice(width, None)}
    if name.endswith("down_proj"):
        parts = {"down_proj": slice(None)}
    tensors: dict[str, torch.Tensor] = {}
    dequantized = torch.empty_like(fused)
    for expert in range(fused.shape[0]):
        for projection, rows in parts.items():
            module = f"{base}.{expert}.{projection}"
            stored, dequantized[expert, rows] = quantize(module, fused[expert, rows])
            tensors.update({module + suffix: value.contiguous() for suffix, value in stored.items()})
    return tensors, dequantized


def int4_expert_tensors(
    name: str, fused: torch.Tensor, spec: QuantSpec, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """quantized_expert_tensors in int4 of `spec`, each projection with its own seed from `seed` on."""
    seeds = iter(range(seed + 1, seed + 1 + 3 * fused.shape[0]))
    return quantized_expert_tensors(name, fused, int4_quantizer(spec, lambda module: next(seeds)))


def without_tensors(source: Path, target: Path, fragment: str) -> Path:
    """`target` as a copy of checkpoint folder `source` (its other files linked) whose model.safetensors
    lacks every tensor whose name holds `fragment` (there must be some)."""
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (target / path.name).symlink_to(path)
    tensors = load_file(str(source / "model.safetensors"))
    kept = {name: tensor for name, tensor in tensors.items() if fragment not in name}
    assert len(kept) < len(tensors), f"no tensor of {source} holds {fragment!r}"
    save_file(kept, str(target / "model.safetensors"))
    return target
