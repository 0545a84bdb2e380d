"""FP8 checkpoints and options fitserve does not run are refused before any weight loads (at config
resolution, `plan_settings`), naming the value, the limit and the fix; an fp8 tensor of the wrong shape
or dtype is refused at load, naming the tensor, what it holds and what was expected."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.planner.resolve import plan_settings
from tests.fp8_checkpoints import Fp8Spec, quantization_config, write_fp8
from tests.quant_checkpoints import QuantSpec, write_quantized
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import DIMS, load_weights, refusal, rewrite_tensor, with_quant_config


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=1)


@pytest.fixture(scope="module")
def ct_folder(hf_model, tmp_path_factory) -> Path:
    return write_fp8(tmp_path_factory.mktemp("ct"), hf_model, Fp8Spec("ct", "channel", "dynamic")).folder


CT = quantization_config(Fp8Spec("ct", "channel", "dynamic"))
GROUP = CT["config_groups"]["group_0"]
HF = quantization_config(Fp8Spec("hf", "block", "dynamic", block=(128, 128)))


def ct_with(weights: dict | None = None, acts: dict | None = None) -> dict:
    group = {**GROUP, "weights": {**GROUP["weights"], **(weights or {})}}
    if acts is not None:
        group["input_activations"] = acts
    return {**CT, "config_groups": {"group_0": group}}


CASES = {
    "ct fp4 weights": (
        ct_with({"num_bits": 4}),
        ["weights num_bits=4 type='float'", "fp8 weights (num_bits 8, type float)", "use an FP8 checkpoint"],
    ),
    "ct group strategy": (
        ct_with({"strategy": "group", "group_size": 128}),
        [
            "strategy='group'",
            "strategy tensor, channel, block",
            "use a checkpoint quantized with one of them",
        ],
    ),
    "ct asymmetric": (ct_with({"symmetric": False}), ["symmetric=false", "symmetric fp8 weights"]),
    "ct int8 activations": (
        ct_with(acts={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
        ["input_activations num_bits=8 type='int'", "fp8 activations (num_bits 8, type float) or none"],
    ),
    "ct static per-token activations": (
        ct_with(acts={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}),
        ["strategy='token' dynamic=False", "dynamic per-token or static per-tensor"],
    ),
    "ct output activations": (
        {**CT, "config_groups": {"group_0": {**GROUP, "output_activations": {"num_bits": 8}}}},
        ["quantizes output activations", "FP8 or FP8_DYNAMIC"],
    ),
    "ct block without structure": (
        ct_with({"strategy": "block", "block_structure": None}),
        ["block_structure=None", "[rows, columns] (e.g. [128, 128])"],
    ),
    "ct mixed schemes": (
        {
            **CT,
            "config_groups": {"a": GROUP, "b": ct_with({"strategy": "tensor"})["config_groups"]["group_0"]},
        },
        ["2 different fp8 schemes", "uniform FP8 checkpoint"],
    ),
    "fp8 e5m2": ({**HF, "fmt": "e5m2"}, ["fmt='e5m2'", "float8 e4m3 weights (fmt e4m3)"]),
    "fp8 unknown activation scheme": (
        {**HF, "activation_scheme": "per-group"},
        ["activation_scheme='per-group'", "dynamic or static"],
    ),
    "fp8 bad block size": (
        {**HF, "weight_block_size": [128]},
        ["weight_block_size=[128]", "[rows, columns]"],
    ),
    "fp8 static blocks": (
        {**HF, "activation_scheme": "static"},
        ["weight_block_size with activation_scheme 'static'", "set activation_scheme to dynamic"],
    ),
    "modelopt": (
        {"quant_method": "modelopt", "quant_algo": "FP8"},
        ["not supported yet: a ModelOpt fp8 weights checkpoint", "quant_method fp8"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_fp8_checkpoints_are_refused_before_loading(case, ct_folder, tmp_path) -> None:
    quant, phrases = CASES[case]
    message = refusal(with_quant_config(ct_folder, tmp_path, quant))
    for phrase in phrases:
        assert phrase in message, message


def test_quantization_fp8_is_refused_on_an_int4_checkpoint(hf_model, tmp_path) -> None:
    folder = write_quantized(tmp_path / "gptq", hf_model, QuantSpec("gptq", 64)).folder
    message = refusal(folder, quantization="fp8")
    assert "--quantization fp8 but the checkpoint is already quantized with 'gptq'" in message
    assert "pass the model's bf16/fp16 release with --quantization fp8" in message


def test_quantization_flag_must_match_an_fp8_checkpoint(ct_folder) -> None:
    message = refusal(ct_folder, quantization="gptq")
    assert "--quantization gptq but the checkpoint is quantized with 'compressed-tensors'" in message
    message = refusal(ct_folder, quantization="fp8")  # as vLLM: the flag names the quant_method
    assert "drop --quantization or set it to compressed-tensors" in message
    plan_settings(EngineArgs(model=str(ct_folder), device="cpu", quantization="compressed-tensors"))


@pytest.mark.parametrize(
    ("name", "change", "says"),
    [
        (
            "model.layers.0.self_attn.k_proj.weight",
            lambda t: t[:-1],
            "has shape (63, 128), expected (64, 128)",
        ),
        (
            "model.layers.1.mlp.down_proj.weight_scale",
            lambda t: t[:64],
            "has shape (64, 1), expected (128, 1)",
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            lambda t: t.to(torch.bfloat16),
            "is torch.bfloat16, expected float8_e4m3fn",
        ),
    ],
)
def test_a_mismatched_fp8_tensor_is_refused_at_load(name, change, says, ct_folder, tmp_path) -> None:
    folder = rewrite_tensor(ct_folder, tmp_path, name, change)
    module = name.rsplit(".", 1)[0]
    with pytest.raises(ValueError, match=re.escape(says)) as error:
        load_weights(folder)
    text = str(error.value)
    assert module.rsplit(".", 1)[0] in text and ("download" in text or "check" in text), text


def test_a_block_scale_of_the_wrong_shape_is_refused_at_load(hf_model, tmp_path) -> None:
    folder = write_fp8(tmp_path / "hf", hf_model, Fp8Spec("hf", "block", "dynamic", block=(64, 64))).folder
    bad = rewrite_tensor(
        folder, tmp_path, "model.layers.0.self_attn.o_proj.weight_scale_inv", lambda t: t[:, :1]
    )
    with pytest.raises(ValueError, match=re.escape("has shape (2, 1), expected (2, 2)")):
        load_weights(bad)


def test_a_non_positive_static_input_scale_is_refused_at_load(hf_model, tmp_path) -> None:
    folder = write_fp8(tmp_path / "st", hf_model, Fp8Spec("ct", "tensor", "static")).folder
    bad = rewrite_tensor(folder, tmp_path, "model.layers.0.self_attn.q_proj.input_scale", lambda t: t * 0)
    with pytest.raises(ValueError, match=r"input_scale \(shard 'q'\) = 0.0: a scale must be positive"):
        load_weights(bad)
