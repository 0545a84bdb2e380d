"""Qwen3.5 / Qwen3.6 MoE FP8 checkpoints (Qwen3.6-35B-A3B-FP8's form) on the CPU, against transformers
running the dequantized weights: the tiny Qwen3_5MoeForConditionalGeneration of test_qwen3_5_moe_int4.py
written with every projection fp8 (attention, DeltaNet, shared expert) and its routed experts fp8 one
tensor set per expert and projection; router and shared-expert gate 16-bit. One whole-sequence forward's
logits match HF's, in HF's block form and compressed-tensors' per-channel form; TP 2 with expert parallel
gives the engine's TP 1 tokens. (Qwen3-MoE: tests/unit/test_qwen3_moe_fp8.py.)"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fp8_checkpoints import Fp8Spec
from tests.unit.quant_helpers import fp8_quantizer, load_model, quantized_expert_tensors
from tests.unit.qwen3_5_helpers import hf_logits
from tests.unit.qwen3_5_quant_helpers import write_fp8
from tests.unit.test_qwen3_5_moe_int4 import TOKENS, _engine_greedy, build_moe

SPECS = {"hf-block": Fp8Spec("hf", "block", block=(32, 32)), "ct-channel": Fp8Spec("ct", "channel")}


@functools.cache
def checkpoint(name: str, root: str) -> tuple[Path, torch.nn.Module]:
    spec = SPECS[name]
    written = write_fp8(Path(root) / name, build_moe(seed=4), spec)
    path = written.folder / "model.safetensors"
    tensors = load_file(str(path))
    state = written.reference.state_dict()
    for fused in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        per_expert, dequantized = quantized_expert_tensors(fused, tensors.pop(fused), fp8_quantizer(spec))
        tensors.update(per_expert)
        with torch.no_grad():
            state[fused].copy_(dequantized)
    save_file(tensors, str(path))
    return written.folder, written.reference


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("qwen3_5_moe_fp8"))


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_follow_the_dequantized_model(root, name):
    from fitserve.layers.attention.metadata import forward_context

    folder, reference = checkpoint(name, root)
    model = load_model(folder)
    assert type(model.model.layers[0].mlp.experts).__name__ == "Fp8FusedExperts"
    with torch.no_grad(), forward_context(None, []):
        got = model.compute_logits(model(torch.tensor(TOKENS), torch.arange(len(TOKENS)))).float()
    want = hf_logits(reference, TOKENS)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < 1e-4, f"logits differ by {error:.2e} (relative)"


def test_tp2_with_expert_parallel_equals_tp1(root):
    """Per-channel scales (the tiny model's 16-row DeltaNet shards cannot be cut from 32-row blocks)."""
    folder, _ = checkpoint("ct-channel", root)
    prompts = [TOKENS[:12], TOKENS[5:30]]
    want = _engine_greedy(folder, prompts)
    assert _engine_greedy(folder, prompts, tensor_parallel_size=2, enable_expert_parallel=True) == want
