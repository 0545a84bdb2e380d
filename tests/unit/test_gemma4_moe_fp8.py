"""Gemma-4 MoE (26B-A4B's form) FP8 checkpoints whose experts are fp8, on the CPU, against transformers
running the dequantized weights: gemma4_quant_helpers' tiny 26B-like model with experts of 64 columns,
written with its attention and dense MLP fp8 and its experts fp8 one tensor set per expert and projection
(the router stays 16-bit), in compressed-tensors' per-channel form and HF's block form. One whole-sequence
forward's logits match HF's. (Qwen3-MoE: tests/unit/test_qwen3_moe_fp8.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fp8_checkpoints import Fp8Spec
from tests.unit.gemma4_quant_helpers import build_model, hf_logits, logits_of, write_fp8
from tests.unit.quant_helpers import fp8_quantizer, load_model, quantized_expert_tensors

SPECS = {"ct-channel": Fp8Spec("ct", "channel"), "hf-block": Fp8Spec("hf", "block", block=(32, 32))}


def write_fp8_experts(folder: Path, spec: Fp8Spec) -> torch.nn.Module:
    """write_fp8's checkpoint (experts left 16-bit) with the experts rewritten as fp8 per expert and taken
    out of the ignore list; returns the HF reference with their dequantized weights."""
    hf_model = build_model("moe_k_eq_v", conditional=spec.fmt == "ct", seed=6, moe_intermediate_size=64)
    written = write_fp8(folder, hf_model, spec)
    path = folder / "model.safetensors"
    tensors, state = load_file(str(path)), written.reference.state_dict()
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        per_expert, dequantized = quantized_expert_tensors(name, tensors.pop(name), fp8_quantizer(spec))
        tensors.update(per_expert)
        with torch.no_grad():
            state[name].copy_(dequantized)
    save_file(tensors, str(path))
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    key = "ignore" if "ignore" in quant else "modules_to_not_convert"
    quant[key] = [pattern for pattern in quant[key] if "experts" not in pattern]
    (folder / "config.json").write_text(json.dumps(config))
    return written.reference


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_follow_the_dequantized_model(tmp_path, name):
    reference = write_fp8_experts(tmp_path, SPECS[name])
    model = load_model(tmp_path)
    assert type(model.model.layers[1].experts).__name__ == "Fp8FusedExperts"
    want, got = hf_logits(reference), logits_of(model)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < 1e-4, f"logits differ by {error:.2e} (relative)"
