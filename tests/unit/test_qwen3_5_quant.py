"""Quantized Qwen3.5 / Qwen3.6 (dense): tiny random models (qwen3_5_quant_helpers) whose every decoder
linear is stored int4 (AWQ, GPTQ with act order, compressed-tensors pack-quantized symmetric and
asymmetric, AutoRound), fp8 (compressed-tensors, quant_method fp8 with blocks) or bitsandbytes 4-bit, or
quantized while loading (--quantization fp8 / bitsandbytes), loaded by fitserve: one whole-sequence
forward's logits match HF's with the dequantized weights. The ignore list is honoured per module by the
checkpoint's names (model.language_model.* in a ConditionalGeneration checkpoint); a MoE quantized in a
form its experts do not run is refused before loading, naming what runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.layers.attention.metadata import forward_context
from fitserve.layers.linear import UnquantizedLinearMethod
from fitserve.layers.quantization.bnb_method import BnbLinearMethod
from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
from fitserve.layers.quantization.fp8_weight import quantize_fp8
from fitserve.layers.quantization.int4_method import Int4LinearMethod
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from tests import bnb_checkpoints
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.quant_helpers import load_model
from tests.unit.qwen3_5_helpers import build_hf, hf_greedy, hf_logits, make_config
from tests.unit.qwen3_5_quant_helpers import (
    SMALL,
    build_model,
    dequantized_reference,
    int4_ignore,
    write_16bit,
    write_bnb,
    write_fp8,
    write_int4,
)

TOKENS = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(1)).tolist()
LAYERS = {  # a module of each kind: (layer index, submodule path)
    "in_proj_qkv": (0, "linear_attn.in_proj_qkv"),
    "in_proj_z": (0, "linear_attn.in_proj_z"),
    "in_proj_b": (0, "linear_attn.in_proj_b"),
    "out_proj": (1, "linear_attn.out_proj"),
    "q_proj": (2, "self_attn.q_proj"),
    "k_proj": (2, "self_attn.k_proj"),
    "o_proj": (2, "self_attn.o_proj"),
    "gate_up_proj": (3, "mlp.gate_up_proj"),
    "down_proj": (3, "mlp.down_proj"),
}


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.tensor(TOKENS)
    with torch.no_grad(), forward_context(None, []):
        return model.compute_logits(model(tokens, torch.arange(len(TOKENS)))).float()


def assert_close(model: torch.nn.Module, reference: torch.nn.Module, tolerance: float) -> None:
    want = hf_logits(reference, TOKENS)
    got = logits_of(model)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < tolerance, f"logits differ by {error:.2e} (relative)"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95


def method_of(model: torch.nn.Module, kind: str) -> Any:
    layer, path = LAYERS[kind]
    return model.model.layers[layer].get_submodule(path).linear_method


INT4 = {
    "awq": QuantSpec("awq", 32, sym=False),
    "gptq-actorder": QuantSpec("gptq", 32, act_order=True),
    "ct-sym": QuantSpec("ct", 32),
    "ct-asym": QuantSpec("ct", 32, sym=False),
    "autoround": QuantSpec("autoround", 32),
}


@pytest.mark.parametrize("name", list(INT4))
def test_int4_checkpoint_matches_the_dequantized_reference(name, tmp_path):
    """Each int4 format: a ConditionalGeneration checkpoint (weights under model.language_model.), whose
    ignore list keeps in_proj_b / in_proj_a 16-bit; every other linear is int4."""
    base = INT4[name]
    model_hf = build_model(conditional=True, seed=2)
    spec = QuantSpec(base.fmt, base.group_size, base.sym, base.act_order, int4_ignore(base.fmt, model_hf))
    checkpoint = write_int4(tmp_path, model_hf, spec)
    model = load_model(checkpoint.folder)
    for kind in LAYERS:
        method = method_of(model, kind)
        if kind in SMALL:
            assert isinstance(method, UnquantizedLinearMethod), kind
        else:
            assert isinstance(method, Int4LinearMethod) and method.runnable is not None, kind
    assert_close(model, checkpoint.reference, 1e-2)


FP8 = {
    "ct-channel": Fp8Spec("ct", "channel"),
    "ct-tensor-static": Fp8Spec("ct", "tensor", activations="static"),
    "hf-block": Fp8Spec("hf", "block", block=(16, 16)),
}


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_checkpoint_matches_the_dequantized_reference(name, tmp_path):
    """fp8 checkpoints: every linear (in_proj_b / in_proj_a too: fp8 packs any shape) is fp8. The CPU runs
    fp8 weight-only (dequantized to the activation dtype): static activation scales do not round the
    activations there."""
    checkpoint = write_fp8(tmp_path, build_model(conditional=False, seed=3), FP8[name])
    model = load_model(checkpoint.folder)
    assert all(isinstance(method_of(model, kind), Fp8LinearMethod) for kind in LAYERS)
    assert_close(model, checkpoint.reference, 1e-2)


def test_bnb_checkpoint_matches_the_dequantized_reference(tmp_path):
    spec = BnbSpec("nf4", double_quant=True, reference_fp16_absmax=True)
    checkpoint = write_bnb(tmp_path, build_model(conditional=True, seed=4), spec)
    model = load_model(checkpoint.folder)
    assert all(isinstance(method_of(model, kind), BnbLinearMethod) for kind in LAYERS)
    assert_close(model, checkpoint.reference, 5e-3)


def _fp8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    quantized = quantize_fp8(weight.float())
    return quantized.data.float() * quantized.scale.float().reshape(-1, 1)


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    return bnb_checkpoints.quantize_spec(weight, BnbSpec("nf4", reference_fp16_absmax=True))[1]


@pytest.mark.parametrize(
    ("flag", "method", "dequantize"),
    [
        ("fp8", Fp8LinearMethod, _fp8_per_channel),
        ("bitsandbytes", BnbLinearMethod, _nf4),
    ],
)
def test_quantization_flag_on_a_16bit_checkpoint(flag, method, dequantize, tmp_path):
    """--quantization fp8 / bitsandbytes on a 16-bit Qwen3.5: every linear quantized while loading (fp8
    per channel, nf4 in blocks of 64), the same as the reference quantized the same way."""
    model_hf = build_model(conditional=True, seed=5)
    folder = write_16bit(tmp_path, model_hf)
    model = load_model(folder, flag)
    assert all(isinstance(method_of(model, kind), method) for kind in LAYERS)
    assert_close(model, dequantized_reference(model_hf, dequantize), 5e-3)


def test_the_ignore_list_names_checkpoint_modules(tmp_path):
    """A ConditionalGeneration checkpoint's compressed-tensors ignore list names its modules as it stores
    them (model.language_model.layers.<i>...), which fitserve reads as model.layers.<i>...: the named
    modules stay 16-bit, their neighbours int4. Naming a projection of a fused layer (gate_proj without
    up_proj) is refused, naming both."""
    model_hf = build_model(conditional=True, seed=6)
    ignore = ("model.language_model.layers.3.mlp.down_proj", *int4_ignore("ct", model_hf))
    checkpoint = write_int4(tmp_path / "a", model_hf, QuantSpec("ct", 32, ignore=ignore))
    model = load_model(checkpoint.folder)
    assert isinstance(model.model.layers[3].mlp.down_proj.linear_method, UnquantizedLinearMethod)
    assert isinstance(model.model.layers[1].mlp.down_proj.linear_method, Int4LinearMethod)
    assert_close(model, checkpoint.reference, 1e-2)
    ignore = ("model.language_model.layers.1.mlp.gate_proj", *int4_ignore("ct", model_hf))
    checkpoint = write_int4(tmp_path / "b", model_hf, QuantSpec("ct", 32, ignore=ignore))
    with pytest.raises(
        ValueError, match=r"leaves model\.language_model\.layers\.1\.mlp\.gate_proj unquantized"
    ):
        load_model(checkpoint.folder)


def test_a_group_size_that_does_not_divide_a_layer_is_refused(tmp_path):
    """Group 32 on MLP inputs of 48: refused as the model is built, naming the module and both numbers."""
    model_hf = build_model(conditional=False, seed=7, intermediate_size=48)
    spec = QuantSpec("awq", 32, ignore=SMALL)
    checkpoint = write_int4(tmp_path, model_hf, QuantSpec("awq", 16, ignore=SMALL))
    config = CheckpointConfig.from_folder(checkpoint.folder)
    config.quantization_config = dict(config.quantization_config, group_size=spec.group_size)
    with pytest.raises(
        ValueError, match=r"group_size=32 does not divide model\.layers\.0\.mlp\.down_proj's "
    ):
        get_model_class(config)(config)


@pytest.mark.parametrize("quant", ["gptq-actorder", "bitsandbytes"])
def test_a_moe_quantized_as_its_experts_do_not_run_is_refused(quant, tmp_path):
    """Qwen3.6-35B-A3B's shape: the fused experts run 16-bit, int4 without act order or fp8, so an
    act-order GPTQ checkpoint (or --quantization bitsandbytes on a 16-bit one) is refused before anything
    loads, saying what runs instead (int4 MoE checkpoints: tests/unit/test_qwen3_5_moe_int4.py)."""
    config_hf = make_config(moe=True, conditional=True)
    folder = tmp_path
    build_hf(config_hf, seed=8).save_pretrained(folder)
    config = CheckpointConfig.from_folder(folder)
    flag = "bitsandbytes" if quant == "bitsandbytes" else None
    if flag is None:
        config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    config = with_quantization_flag(config, flag)
    with pytest.raises(ValueError) as error:
        get_model_class(config)(config)
    message = str(error.value)
    assert "Qwen3.5 MoE model" in message and "4 experts" in message
    assert "fused MoE experts run 16-bit, int4 (without act order) or fp8 weights" in message
    assert ("not int4 with act order" if flag is None else "not this format") in message
    assert "AWQ / GPTQ (desc_act false)" in message
    assert "16-bit one as it is or with --quantization fp8" in message


def _engine_greedy(folder: Path, **kwargs: Any) -> list[int]:
    from fitserve import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=16, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        output = llm.generate([{"prompt_token_ids": TOKENS[:20]}], params, use_tqdm=False)[0]
        return list(output.outputs[0].token_ids)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["bnb", "fp8", "fp8-flag"])
def test_the_engine_serves_them(kind, tmp_path):
    """Through the engine (the plan's checks of the checkpoint's headers and shapes, then the workers'
    load): greedy tokens equal HF's with the dequantized weights."""
    model_hf = build_model(conditional=True, seed=9)
    flag = None
    if kind == "bnb":
        checkpoint = write_bnb(tmp_path, model_hf, BnbSpec("nf4", reference_fp16_absmax=True))
        folder, reference = checkpoint.folder, checkpoint.reference
    elif kind == "fp8":
        checkpoint = write_fp8(tmp_path, model_hf, Fp8Spec("ct", "channel"))
        folder, reference = checkpoint.folder, checkpoint.reference
    else:
        folder, flag = write_16bit(tmp_path, model_hf), "fp8"
        reference = dequantized_reference(model_hf, _fp8_per_channel)
    assert _engine_greedy(folder, quantization=flag) == hf_greedy(reference, TOKENS[:20], 8)
