"""Int4 checkpoints fitserve does not run are refused before any weight loads (at config resolution,
`plan_settings`), naming the value, the limit and the fix; a quantized tensor of the wrong shape is refused
at load, naming the tensor and both shapes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.planner.resolve import plan_settings
from tests.quant_checkpoints import QuantSpec, quantization_config, write_quantized
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import DIMS, load_weights, refusal, rewrite_tensor, with_quant_config


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=1)


@pytest.fixture(scope="module")
def gptq_folder(hf_model, tmp_path_factory) -> Path:
    return write_quantized(
        tmp_path_factory.mktemp("gptq"), hf_model, QuantSpec("gptq", 64, act_order=True)
    ).folder


GPTQ = quantization_config(QuantSpec("gptq", 64))
CT = quantization_config(QuantSpec("ct", 64))
CASES = {
    "unknown quant_method": (
        {"quant_method": "hqq", "bits": 4},
        ["quant_method='hqq' is not a format fitserve runs", "GPTQ", "use the model's unquantized release"],
    ),
    "gptq bits 3": ({**GPTQ, "bits": 3}, ["GPTQ bits=3", "4-bit GPTQ checkpoints only", "(bits 4)"]),
    "gptq bits 8": ({**GPTQ, "bits": 8}, ["GPTQ bits=8", "use the model's 4-bit GPTQ release"]),
    "awq bits 8": (
        {**quantization_config(QuantSpec("awq", 64, sym=False)), "bits": 8},
        ["AWQ bits=8", "4-bit AWQ"],
    ),
    "group size not dividing": (
        {**GPTQ, "group_size": 256},
        ["group_size=256 does not divide", "input dim 128", "use a checkpoint quantized with a group size"],
    ),
    "odd group size": ({**GPTQ, "group_size": 48}, ["GPTQ group_size=48", "32, 64, 128, 256"]),
    "awq gemv": (
        {**quantization_config(QuantSpec("awq", 64, sym=False)), "version": "gemv"},
        ["AWQ version='gemv'", "AWQ GEMM checkpoints (version gemm)"],
    ),
    "gptq marlin": (
        {**GPTQ, "checkpoint_format": "marlin"},
        ["checkpoint_format='marlin'", "plain GPTQ release"],
    ),
    "gptq is_marlin_format": ({**GPTQ, "is_marlin_format": True}, ["checkpoint_format='marlin'"]),
    "autoround awq packing": (
        {**quantization_config(QuantSpec("autoround", 64)), "packing_format": "auto_round:auto_awq"},
        ["packing_format='auto_round:auto_awq'", "auto_round:auto_gptq"],
    ),
    "ct float-quantized with int4 weights": (
        {**CT, "format": "float-quantized"},
        ["weights num_bits=4 type='int' in a float-quantized checkpoint", "(num_bits 8, type float)"],
    ),
    "ct int-quantized": (
        {
            **CT,
            "format": "int-quantized",
            "config_groups": {"g": {**CT["config_groups"]["group_0"], "format": None}},
        },
        ["format 'int-quantized'", "'pack-quantized' (int4 W4A16) only"],
    ),
    "ct activations": (
        {
            **CT,
            "config_groups": {
                "g": {**CT["config_groups"]["group_0"], "input_activations": {"num_bits": 8, "type": "int"}}
            },
        },
        ["quantizes activations", "weight-only W4A16"],
    ),
    "ct 8 bits": (
        {
            **CT,
            "config_groups": {
                "g": {
                    **CT["config_groups"]["group_0"],
                    "weights": {**CT["config_groups"]["group_0"]["weights"], "num_bits": 8},
                }
            },
        },
        ["num_bits=8", "num_bits 4, type int"],
    ),
    "bitsandbytes 8-bit checkpoint": (
        {"quant_method": "bitsandbytes", "load_in_8bit": True},
        ["bitsandbytes 8-bit (quantization_config.load_in_8bit=true", "--quantization bitsandbytes"],
    ),
    "fbgemm fp8 checkpoint": (
        {"quant_method": "fbgemm_fp8"},
        ["not supported yet: a fbgemm fp8 weights checkpoint", "GPTQ, AWQ", "--quantization fp8"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_checkpoints_are_refused_before_loading(case, gptq_folder, tmp_path) -> None:
    quant, phrases = CASES[case]
    message = refusal(with_quant_config(gptq_folder, tmp_path, quant))
    for phrase in phrases:
        assert phrase in message, message


def test_quantization_flag_must_name_the_checkpoints_method(gptq_folder) -> None:
    message = refusal(gptq_folder, quantization="awq")
    assert "--quantization awq but the checkpoint is quantized with 'gptq'" in message
    assert "drop --quantization or set it to gptq" in message
    plan_settings(EngineArgs(model=str(gptq_folder), device="cpu", quantization="gptq_marlin"))


def test_quantization_flag_needs_a_quantized_checkpoint(gptq_folder, tmp_path) -> None:
    message = refusal(with_quant_config(gptq_folder, tmp_path, None), quantization="gptq")
    assert "--quantization gptq needs a checkpoint quantized with gptq" in message
    assert "drop --quantization" in message


@pytest.mark.parametrize("flag", ["modelopt"])
def test_quantizing_while_loading_is_not_yet(flag, gptq_folder, tmp_path) -> None:
    message = refusal(with_quant_config(gptq_folder, tmp_path, None), quantization=flag)
    assert message.startswith(f"not supported yet: --quantization {flag} (drop --quantization; the closest")
    assert "int4 GPTQ, AWQ, compressed-tensors or AutoRound checkpoint" in message


@pytest.mark.parametrize(
    ("name", "change", "shapes"),
    [
        (
            "model.layers.0.self_attn.k_proj.qweight",
            lambda t: t[:-1],
            "has shape (15, 64), expected (16, 64)",
        ),
        ("model.layers.1.mlp.down_proj.scales", lambda t: t[:, :32], "has shape (4, 32), expected (4, 128)"),
        ("model.layers.0.mlp.up_proj.qzeros", lambda t: t[:1], "has shape (1, 32), expected (2, 32)"),
        ("model.layers.0.self_attn.o_proj.g_idx", lambda t: t[:100], "has shape (100,), expected (128,)"),
    ],
)
def test_a_truncated_quantized_tensor_is_refused_at_load(name, change, shapes, gptq_folder, tmp_path) -> None:
    folder = rewrite_tensor(gptq_folder, tmp_path, name, change)
    module = name.rsplit(".", 1)[0]
    with pytest.raises(ValueError, match=re.escape(shapes)) as error:
        load_weights(folder)
    assert module.rsplit(".", 1)[0] in str(error.value) and "download it again" in str(error.value)


def test_fused_projections_must_share_their_g_idx(gptq_folder, tmp_path) -> None:
    folder = rewrite_tensor(
        gptq_folder, tmp_path, "model.layers.0.self_attn.v_proj.g_idx", lambda t: t.flip(0)
    )
    with pytest.raises(ValueError, match="must share one g_idx"):
        load_weights(folder)
