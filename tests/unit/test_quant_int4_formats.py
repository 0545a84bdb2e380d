"""Every int4 checkpoint format fitserve loads (GPTQ, AWQ, compressed-tensors pack-quantized, AutoRound),
written by tests/quant_checkpoints.py from each format's specification, loaded into tiny Llama / Qwen2 /
Qwen3 models:

(a) the weights fitserve unpacks (the canonical Int4Weight, dequantized) equal the reference weights the
    checkpoint was quantized to, exactly;
(b) the model's logits equal those of the HF model holding the dequantized float32 weights: within 1e-5
    (relative to the largest logit) when the layer dequantizes at load, 5e-3 on fitserve's C int4 kernel
    (float16 step and minimum, activations rounded to int8 levels per 32 columns), 3e-2 on torch's int4
    kernel (bf16 activations, scales and zeros).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fitserve.layers.quantization.int4_method as int4_method
from fitserve.layers.quantization.int4_weight import dequantize
from fitserve.models.loader import load_hf_config
from fitserve.models.registry import get_model_class
from fitserve.models.weights import iterate_safetensors, list_safetensors_files
from tests.quant_checkpoints import QuantSpec, write_quantized
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config

# hidden 128 and intermediate 256, so that group sizes 32, 64 and 128 divide every layer's input
DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = [5, 17, 33, 2, 90, 11, 200, 3]
SPECS = [
    QuantSpec("gptq", 128),
    QuantSpec("gptq", 32, sym=False),
    QuantSpec("gptq", 64, sym=False, act_order=True),
    QuantSpec("gptq", -1, sym=False),
    QuantSpec("gptq_v2", 64, sym=False, ignore=("model.layers.1.mlp.down_proj",)),
    QuantSpec("awq", 128, sym=False),
    QuantSpec("awq", 32, sym=False, ignore=("model.layers.0.self_attn.o_proj",)),
    QuantSpec("ct", 128),
    QuantSpec("ct", 32, sym=False),
    QuantSpec("ct", -1),
    QuantSpec("ct", 64, act_order=True),
    QuantSpec("ct", 64, sym=False, packed_zero_point=False),
    QuantSpec("ct", 32, ignore=("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")),
    QuantSpec("autoround", 128),
    QuantSpec("autoround", 32, sym=False, ignore=("model.layers.0.mlp.down_proj",)),
]
TOLERANCE = {"dequantized": 1e-5, "c-kernel": 5e-3, "torch-int4": 3e-2}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def hf_model(request) -> torch.nn.Module:
    return build_hf_model(tiny_hf_config(request.param, **DIMS), seed=2)


def load_capturing(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, dict, object]:
    """The fitserve model of `folder`, and each quantized layer's Int4Weight by layer name."""
    captured: dict[int, object] = {}
    make_runnable = int4_method.make_runnable

    def capture(layer, weight, dtype, what, device=None, store_on=None):
        captured[id(layer)] = weight
        return make_runnable(layer, weight, dtype, what, device, store_on=store_on)

    monkeypatch.setattr(int4_method, "make_runnable", capture)
    config = load_hf_config(str(folder))
    model = get_model_class(config)(config).eval()
    loaded = model.load_weights(iterate_safetensors(list_safetensors_files(str(folder))))
    assert not {name for name, _ in model.named_parameters()} - loaded
    weights = {name: captured[id(module)] for name, module in model.named_modules() if id(module) in captured}
    return model, weights, config


def reference_of(checkpoint, layer_name: str) -> torch.Tensor:
    prefix, _, layer = layer_name.rpartition(".")
    parts = FUSED.get(layer, (layer,))
    return torch.cat([checkpoint.reference[f"{prefix}.{part}"] for part in parts])


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name + ("-ignore" if spec.ignore else ""))
def test_loaded_weights_and_logits_match_the_reference(hf_model, spec, tmp_path, monkeypatch) -> None:
    checkpoint = write_quantized(tmp_path / spec.name, hf_model, spec)
    model, weights, config = load_capturing(checkpoint.folder, monkeypatch)
    # (a) every quantized layer, and only those, unpacked to exactly the reference weights
    ignored_layers = {name.rsplit(".", 1)[0] + "." + _fused_name(name) for name in spec.ignore}
    expected_layers = 2 * 4 - len(ignored_layers)
    assert len(weights) == expected_layers
    for name, weight in weights.items():
        assert torch.equal(dequantize(weight), reference_of(checkpoint, name)), name
        assert (weight.perm is not None) == spec.act_order, name
    # (b) logits against the HF model with the dequantized weights
    expected = hf_logits(checkpoint.dequantized_model, TOKENS)
    got = PagedTestRunner(model, config).step([("seq", TOKENS)])[0]
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error < max(TOLERANCE[path] for path in _paths(model)), (error, _paths(model))


def _fused_name(module: str) -> str:
    leaf = module.rsplit(".", 1)[1]
    return next((fused for fused, parts in FUSED.items() if leaf in parts), leaf)


def _paths(model: torch.nn.Module) -> set[str]:
    return {
        module.linear_method.path
        for module in model.modules()
        if isinstance(getattr(module, "linear_method", None), int4_method.Int4LinearMethod)
    }


@pytest.mark.parametrize(
    ("env", "path"),
    [
        ({}, "c-kernel"),
        ({"FITSERVE_CPU_KERNELS": "0"}, "torch-int4"),
        ({"FITSERVE_CPU_INT4": "0"}, "dequantized"),
    ],
)
def test_each_cpu_path_computes_the_same_logits(env, path, tmp_path, monkeypatch) -> None:
    from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels
    from fitserve.layers.cpu.int4_linear import kernel_available

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if path == "c-kernel" and load_cpu_kernels() is None:
        pytest.skip("fitserve's C int4 kernel does not build on this machine")
    if path == "torch-int4" and not kernel_available():
        pytest.skip("torch has no CPU int4 kernel here")
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=4)
    checkpoint = write_quantized(
        tmp_path / "gptq", hf_model, QuantSpec("gptq", 64, sym=False, act_order=True)
    )
    model, _, config = load_capturing(checkpoint.folder, monkeypatch)
    assert _paths(model) == {path}
    expected = hf_logits(checkpoint.dequantized_model, TOKENS)
    got = PagedTestRunner(model, config).step([("seq", TOKENS)])[0]
    assert float((got - expected).abs().max() / expected.abs().max()) < TOLERANCE[path]


def test_group_size_not_a_multiple_of_32_dequantizes_at_load(tmp_path, monkeypatch) -> None:
    """No int4 kernel takes groups of 16 here: the weight is dequantized once at load, exactly."""
    import fitserve.layers.quantization.quant_formats as quant_formats

    monkeypatch.setattr(quant_formats, "GROUP_SIZES", (*quant_formats.GROUP_SIZES, 16))
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=5)
    checkpoint = write_quantized(tmp_path / "g16", hf_model, QuantSpec("gptq", 16, sym=False))
    model, _, config = load_capturing(checkpoint.folder, monkeypatch)
    assert _paths(model) == {"dequantized"}
    expected = hf_logits(checkpoint.dequantized_model, TOKENS)
    got = PagedTestRunner(model, config).step([("seq", TOKENS)])[0]
    assert float((got - expected).abs().max() / expected.abs().max()) < TOLERANCE["dequantized"]
