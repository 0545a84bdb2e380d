"""Quantized Gemma-4: tiny random models (gemma4_quant_helpers: the E model with per-layer inputs and KV
sharing, a dense sliding/full model with K=V full layers, the MoE) whose linears are stored int4 (AWQ,
GPTQ with act order, compressed-tensors symmetric and asymmetric), fp8 (compressed-tensors per channel,
quant_method fp8 with blocks) or bitsandbytes 4-bit, or quantized while loading (--quantization fp8),
loaded by fitserve: one whole-sequence forward's logits match HF's with the dequantized weights. The
ignore list is honoured per module under either name (model.language_model.* as a ConditionalGeneration
checkpoint lists it, or model.*); a format that quantizes the MoE experts is refused before building,
naming what runs, and a MoE checkpoint whose ignore list keeps its experts 16-bit runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fitserve.layers.linear import UnquantizedLinearMethod
from fitserve.layers.quantization.bnb_method import BnbLinearMethod
from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
from fitserve.layers.quantization.fp8_weight import quantize_fp8
from fitserve.layers.quantization.int4_method import Int4LinearMethod
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.gemma4_quant_helpers import (
    GROUP,
    build_model,
    dequantized_reference,
    hf_logits,
    int4_ignore,
    logits_of,
    write_16bit,
    write_bnb,
    write_fp8,
    write_int4,
)
from tests.unit.quant_helpers import load_model


def assert_close(model: torch.nn.Module, reference: torch.nn.Module, tolerance: float) -> None:
    want, got = hf_logits(reference), logits_of(model)
    assert got is not None
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < tolerance, f"logits differ by {error:.2e} (relative)"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95


def linears(model: torch.nn.Module) -> dict[str, Any]:
    """Every linear layer's method by its parameter path (the LM head aside)."""
    return {
        name: module.linear_method
        for name, module in model.named_modules()
        if hasattr(module, "linear_method") and not name.startswith("lm_head")
    }


def assert_methods(model: torch.nn.Module, method: type) -> None:
    """Every linear runs `method` but the MoE router's projection (16-bit, as the checkpoints keep it)."""
    for name, found in linears(model).items():
        want = UnquantizedLinearMethod if name.endswith("router.proj") else method
        assert isinstance(found, want), f"{name}: {type(found).__name__}, not {want.__name__}"


INT4 = {  # name -> (case, ConditionalGeneration form, spec)
    "e-ct-sym": ("e_model", True, QuantSpec("ct", GROUP)),
    "e-awq": ("e_model", False, QuantSpec("awq", GROUP, sym=False)),
    "dense-gptq-actorder": ("dense", False, QuantSpec("gptq", GROUP, act_order=True)),
    "dense-ct-asym": ("dense", True, QuantSpec("ct", GROUP, sym=False)),
    "moe-ct": ("moe_k_eq_v", True, QuantSpec("ct", GROUP)),
    "moe-awq": ("moe_k_eq_v", False, QuantSpec("awq", GROUP, sym=False)),
}


@pytest.mark.parametrize("name", list(INT4))
def test_int4_checkpoint_matches_the_dequantized_reference(name, tmp_path):
    """Each int4 format on each model: every linear outside the experts int4 (the E model's per-layer
    gate, projection and model projection too; KV-shared layers' q-only qkv; K=V full layers' q/k), the
    router and the experts left 16-bit by the ignore list (the MoE runs: its experts are not quantized)."""
    case, conditional, base = INT4[name]
    spec = QuantSpec(base.fmt, base.group_size, base.sym, base.act_order, int4_ignore(base.fmt))
    checkpoint = write_int4(tmp_path, build_model(case, conditional, seed=2), spec)
    model = load_model(checkpoint.folder)
    assert_methods(model, Int4LinearMethod)
    assert all(
        method.runnable is not None for method in linears(model).values() if hasattr(method, "runnable")
    )
    if case == "e_model":
        assert isinstance(model.model.per_layer_model_projection.linear_method, Int4LinearMethod)
        assert model.model.layers[4].self_attn.qkv_proj.shard_ids == ("q",)  # KV-shared
    assert_close(model, checkpoint.reference, 1e-2)


FP8 = {
    "e-ct-channel": ("e_model", Fp8Spec("ct", "channel")),
    "moe-hf-block": ("moe_k_eq_v", Fp8Spec("hf", "block", block=(16, 16))),
}


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_checkpoint_matches_the_dequantized_reference(name, tmp_path):
    """fp8 checkpoints (the CPU runs fp8 weight-only, dequantized to the activation dtype)."""
    case, spec = FP8[name]
    checkpoint = write_fp8(tmp_path, build_model(case, conditional=False, seed=3), spec)
    model = load_model(checkpoint.folder)
    assert_methods(model, Fp8LinearMethod)
    assert_close(model, checkpoint.reference, 1e-2)


def test_bnb_checkpoint_matches_the_dequantized_reference(tmp_path):
    spec = BnbSpec("nf4", double_quant=True, blocksize=32, reference_fp16_absmax=True)  # hidden 32
    checkpoint = write_bnb(tmp_path, build_model("dense", conditional=True, seed=4), spec)
    model = load_model(checkpoint.folder)
    assert_methods(model, BnbLinearMethod)
    assert_close(model, checkpoint.reference, 5e-3)


def _fp8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    quantized = quantize_fp8(weight.float())
    return quantized.data.float() * quantized.scale.float().reshape(-1, 1)


def test_quantization_fp8_on_a_16bit_checkpoint(tmp_path):
    """--quantization fp8 on a 16-bit E model: every linear quantized per channel while loading, the
    same as the reference quantized the same way."""
    model_hf = build_model("e_model", conditional=True, seed=5)
    model = load_model(write_16bit(tmp_path, model_hf), "fp8")
    assert_methods(model, Fp8LinearMethod)
    assert_close(model, dequantized_reference(model_hf, _fp8_per_channel), 5e-3)


def test_the_ignore_list_names_modules_under_either_prefix(tmp_path):
    """A ConditionalGeneration checkpoint's compressed-tensors ignore list naming a module as the
    checkpoint stores it (model.language_model.layers.<i>...) or as fitserve reads it (model.layers.<i>...)
    keeps it 16-bit, its neighbours int4. Naming one projection of a fused layer (k_proj without q_proj)
    is refused, naming it."""
    model_hf = build_model("e_model", conditional=True, seed=6)
    ignore = (
        "model.language_model.layers.1.mlp.down_proj",
        "model.language_model.layers.2.per_layer_input_gate",
        *int4_ignore("ct"),
    )
    checkpoint = write_int4(tmp_path / "a", model_hf, QuantSpec("ct", GROUP, ignore=ignore))
    model = load_model(checkpoint.folder)
    layers = model.model.layers
    assert isinstance(layers[1].mlp.down_proj.linear_method, UnquantizedLinearMethod)
    assert isinstance(layers[2].per_layer_input_gate.linear_method, UnquantizedLinearMethod)
    assert isinstance(layers[2].mlp.down_proj.linear_method, Int4LinearMethod)
    assert isinstance(layers[1].per_layer_input_gate.linear_method, Int4LinearMethod)
    assert_close(model, checkpoint.reference, 1e-2)
    # the read form: fitserve's name of layer 3's o_proj (the checkpoint writer keeps it 16-bit by hand)
    config = CheckpointConfig.from_folder(checkpoint.folder)
    config.quantization_config = dict(
        config.quantization_config,
        ignore=[*config.quantization_config["ignore"], "model.layers.3.self_attn.o_proj"],
    )
    built = get_model_class(config)(config)
    assert isinstance(built.model.layers[3].self_attn.o_proj.linear_method, UnquantizedLinearMethod)
    assert isinstance(built.model.layers[2].self_attn.o_proj.linear_method, Int4LinearMethod)
    config.quantization_config = dict(
        config.quantization_config,
        ignore=[*config.quantization_config["ignore"], "model.language_model.layers.0.self_attn.k_proj"],
    )
    with pytest.raises(
        ValueError, match=r"leaves model\.language_model\.layers\.0\.self_attn\.k_proj unquantized"
    ):
        get_model_class(config)(config)


def test_a_group_size_that_does_not_divide_a_layer_is_refused(tmp_path):
    """Group 32 on an MLP input of 48: refused as the model is built, naming the module and both numbers."""
    model_hf = build_model("dense", conditional=False, seed=7, intermediate_size=48)
    config_folder = tmp_path
    model_hf.save_pretrained(config_folder)
    config = CheckpointConfig.from_folder(config_folder)
    config.quantization_config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ["router", "experts"],
    }
    with pytest.raises(
        ValueError, match=r"group_size=32 does not divide model\.layers\.0\.mlp\.down_proj's input dim 48"
    ):
        get_model_class(config)(config)


def _moe_config(tmp_path, quantization: dict[str, Any] | None, flag: str | None = None) -> Any:
    build_model("moe_k_eq_v", conditional=True, seed=8).save_pretrained(tmp_path)
    config = CheckpointConfig.from_folder(tmp_path)
    if quantization is not None:
        config.quantization_config = quantization
    return with_quantization_flag(config, flag)


CT_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
        }
    },
}


@pytest.mark.parametrize(
    ("quantization", "flag", "why"),
    [
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
            None,
            "int4 with act order",
        ),
        (None, "bitsandbytes", "this format"),
    ],
)
def test_experts_quantized_as_they_do_not_run_are_refused(quantization, flag, why, tmp_path):
    """26B-A4B's shape: experts run 16-bit or an int4 checkpoint's without act order, so an act-order
    checkpoint whose ignore list does not keep them 16-bit (or --quantization bitsandbytes on a 16-bit
    MoE) is refused before anything is built, saying why and what runs (int4 experts:
    tests/unit/test_gemma4_moe_int4.py)."""
    config = _moe_config(tmp_path, quantization, flag)
    with pytest.raises(ValueError) as error:
        get_model_class(config)(config)
    message = str(error.value)
    assert "Gemma-4 MoE model (Gemma4ForConditionalGeneration, 6 experts)" in message
    assert f"run 16-bit, int4 (without act order) or fp8 weights, not {why}" in message
    assert "AWQ / GPTQ (desc_act false)" in message
    assert "16-bit one as it is or with --quantization fp8" in message


def test_experts_in_the_ignore_list_build(tmp_path):
    """The same config with the experts in its ignore list builds: attention and dense MLP int4, the
    router (also ignored) and the experts 16-bit."""
    config = _moe_config(tmp_path, {**CT_INT4, "ignore": ["lm_head", "re:.*router.*", "re:.*experts.*"]})
    model = get_model_class(config)(config)
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj.linear_method, Int4LinearMethod)
    assert layer.self_attn.qkv_proj.shard_ids == ("q", "k")  # K=V full layer
    assert isinstance(layer.mlp.gate_up_proj.linear_method, Int4LinearMethod)
    assert isinstance(layer.router.proj.linear_method, UnquantizedLinearMethod)
    assert layer.experts.gate_up_proj.dtype in (torch.float32, torch.bfloat16, torch.float16)


def test_a_16bit_router_the_ignore_list_misses_is_named(tmp_path):
    """A MoE checkpoint keeping the router 16-bit without naming it in its ignore list (8 experts: int4
    could pack it): refused while loading, naming the tensor and the fix, not as an unknown tensor."""
    model_hf = build_model("moe_k_eq_v", conditional=False, seed=10, num_experts=8)
    checkpoint = write_int4(tmp_path, model_hf, QuantSpec("ct", GROUP, ignore=("re:.*experts.*",)))
    with pytest.raises(ValueError) as error:
        load_model(checkpoint.folder)
    message = str(error.value)
    assert "'model.layers.0.router.proj.weight' is a 16-bit weight" in message
    assert "add the module to the ignore list" in message
