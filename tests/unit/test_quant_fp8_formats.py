"""Every fp8 checkpoint format fitserve loads (compressed-tensors float-quantized, quant_method fp8), written
by tests/fp8_checkpoints.py from each format's specification, loaded into tiny Llama / Qwen3 models:

(a) the weights fitserve holds (the canonical Fp8Weight, dequantized) equal the reference weights the
    checkpoint was quantized to, exactly, fused projections each with its own scale;
(b) the logits equal those of the HF model holding the dequantized float32 weights within 1e-5 of the
    largest logit (the CPU runs weight-only: the fp8 weight dequantized per call, exactly, to float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fitserve.layers.quantization.fp8_method as fp8_method
from fitserve.layers.quantization.fp8_weight import dequantize
from fitserve.models.loader import load_hf_config
from fitserve.models.registry import get_model_class
from fitserve.models.weights import iterate_safetensors, list_safetensors_files
from tests.fp8_checkpoints import Fp8Spec, write_fp8
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config

# hidden 96 (not a multiple of the 64-column block below: partial blocks at the edge), intermediate 160
DIMS = {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = [5, 17, 33, 2, 90, 11, 200, 3]
SPECS = [
    Fp8Spec("ct", "channel", "dynamic"),
    Fp8Spec("ct", "channel", "none"),
    Fp8Spec("ct", "tensor", "static"),
    Fp8Spec("ct", "tensor", "dynamic", ignore=("model.layers.1.mlp.down_proj",)),
    Fp8Spec("ct", "block", "dynamic", block=(32, 32)),
    Fp8Spec("hf", "block", "dynamic", block=(32, 32)),
    Fp8Spec(
        "hf", "block", "dynamic", block=(64, 64)
    ),  # k/v shards of 48 rows: blocks cross the shards' edges
    Fp8Spec("hf", "tensor", "static"),
    Fp8Spec("hf", "tensor", "dynamic", ignore=("model.layers.0.self_attn.o_proj",)),
]
TOLERANCE = 1e-5
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def hf_model(request) -> torch.nn.Module:
    return build_hf_model(tiny_hf_config(request.param, **DIMS), seed=3)


def load_capturing(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, dict, object]:
    """The fitserve model of `folder`, and each fp8 layer's Fp8Weight by layer name."""
    captured: dict[int, object] = {}
    make = fp8_method.make_fp8_runnable

    def capture(layer, weight, *args):
        captured[id(layer)] = weight
        return make(layer, weight, *args)

    monkeypatch.setattr(fp8_method, "make_fp8_runnable", capture)
    config = load_hf_config(str(folder))
    model = get_model_class(config)(config).eval()
    loaded = model.load_weights(iterate_safetensors(list_safetensors_files(str(folder))))
    assert not {name for name, _ in model.named_parameters()} - loaded
    weights = {name: captured[id(module)] for name, module in model.named_modules() if id(module) in captured}
    return model, weights, config


def reference_of(checkpoint, layer_name: str) -> torch.Tensor:
    prefix, _, layer = layer_name.rpartition(".")
    return torch.cat([checkpoint.reference[f"{prefix}.{part}"] for part in FUSED.get(layer, (layer,))])


def paths(model: torch.nn.Module) -> set[str]:
    return {
        module.linear_method.path
        for module in model.modules()
        if isinstance(getattr(module, "linear_method", None), fp8_method.Fp8LinearMethod)
    }


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_loaded_weights_and_logits_match_the_reference(hf_model, spec, tmp_path, monkeypatch) -> None:
    checkpoint = write_fp8(tmp_path / spec.name, hf_model, spec)
    model, weights, config = load_capturing(checkpoint.folder, monkeypatch)
    assert len(weights) == 2 * 4 - len(spec.ignore)
    for name, weight in weights.items():
        assert torch.equal(dequantize(weight), reference_of(checkpoint, name)), name
    assert paths(model) == {"weight-only"}
    for module in model.modules():  # kept fp8: one byte a weight
        if isinstance(getattr(module, "linear_method", None), fp8_method.Fp8LinearMethod):
            assert module.fp8_weight.dtype == torch.float8_e4m3fn
    expected = hf_logits(checkpoint.dequantized_model, TOKENS)
    got = PagedTestRunner(model, config).step([("seq", TOKENS)])[0]
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error < TOLERANCE, error


def test_fused_per_tensor_scales_stay_per_shard(tmp_path, monkeypatch) -> None:
    """q, k and v quantized with very different per-tensor scales: each keeps its own (not one shared)."""
    hf = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=5)
    with torch.no_grad():
        hf.model.layers[0].self_attn.k_proj.weight.mul_(30.0)
        hf.model.layers[0].self_attn.v_proj.weight.mul_(0.01)
    checkpoint = write_fp8(tmp_path / "t", hf, Fp8Spec("ct", "tensor", "dynamic"))
    _, weights, _ = load_capturing(checkpoint.folder, monkeypatch)
    qkv = weights["model.layers.0.self_attn.qkv_proj"]
    assert len(set(qkv.scale.flatten().tolist())) == 3
    assert torch.equal(dequantize(qkv), reference_of(checkpoint, "model.layers.0.self_attn.qkv_proj"))
