"""The quantized Qwen3.6 configs of the field report (issues 28 and 32: Qwen3.6-27B-AWQ-INT4, a
compressed-tensors pack-quantized int4 checkpoint, symmetric, group 32, on two RTX 2080 Ti) without a
weight file: the model built on the meta device honours its ignore list module by module, the planner
counts its stored weight bytes (int4 packed codes and scales, the ignored modules and the tables at 16 bits)
as derived here from the config by hand; an int4 MoE is planned with its experts int4, and an fp8 one refused
before the engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fitserve.layers.linear import UnquantizedLinearMethod
from fitserve.layers.quantization.int4_method import Int4LinearMethod
from fitserve.layers.quantization.layer_projections import qwen3_5_quantized
from fitserve.layers.quantization.methods import stored_from_config
from fitserve.layers.quantization.quant_config import quant_format
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from fitserve.planner.model_info import inspect_model
from fitserve.planner.quantized_checkpoint import check_quantized_checkpoint
from tests.paths import MODELS_DIR
from tests.unit.tp_helpers import on_rank

AWQ_27B = MODELS_DIR / "qwen3.6-27b-awq-int4"
BF16_27B = MODELS_DIR / "qwen3.6-27b"
MOE = MODELS_DIR / "qwen3.6-35b-a3b"

# Qwen3.6-27B: hidden 5120, MLP 17408, 24 heads and 4 KV heads of 256, DeltaNet 16 key heads and 48 value
# heads of 128; 16 full-attention and 48 DeltaNet layers.
HIDDEN, MLP = 5120, 17_408
FULL = HIDDEN * 2 * 24 * 256 + 2 * HIDDEN * 4 * 256 + 24 * 256 * HIDDEN  # q (with its gate), k, v, o
DELTA_NET = HIDDEN * (2 * 16 * 128 + 48 * 128) + HIDDEN * 48 * 128 + 48 * 128 * HIDDEN  # qkv, z, out
MLP_PARAMS = 3 * HIDDEN * MLP
QUANTIZED_PARAMS = 16 * (FULL + MLP_PARAMS) + 48 * (DELTA_NET + MLP_PARAMS)  # in_proj_b / a: ignored
QUANTIZED_LAYERS = 16 * 7 + 48 * 6
# pack-quantized int4, group 32: half a byte a weight, a 16-bit scale a group, weight_shape (2 x int64)
STORED_BYTES = QUANTIZED_PARAMS // 2 + QUANTIZED_PARAMS // 32 * 2 + QUANTIZED_LAYERS * 16


def need(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} is not here")


def test_the_planner_counts_the_stored_int4_bytes():
    need(AWQ_27B)
    config = CheckpointConfig.from_folder(AWQ_27B)
    fmt = quant_format(config)
    assert stored_from_config(fmt, config) == (QUANTIZED_PARAMS, STORED_BYTES)
    assert STORED_BYTES == 13_683_923_200  # about 27 B x 0.5 bytes, plus the scales
    quantized = qwen3_5_quantized(fmt, config)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv" in quantized
    assert "model.language_model.layers.0.linear_attn.in_proj_b" not in quantized
    assert len(quantized) == QUANTIZED_LAYERS  # checkpoint modules: gate_proj and up_proj are two


def test_dummy_weights_inventory_holds_the_rest_at_16_bits():
    """--load-format dummy: the int4 projections at their stored bytes, everything else (embedding, LM
    head, in_proj_b / in_proj_a, norms, conv1d, decays) as 16-bit parameters: together the bf16 27B's
    parameters."""
    need(AWQ_27B)
    need(BF16_27B)
    weights = inspect_model(str(AWQ_27B), load_format="dummy").weights
    whole = inspect_model(str(BF16_27B), load_format="dummy").weights.counts.total
    assert weights.stored_bytes == STORED_BYTES
    assert weights.counts.total == whole - QUANTIZED_PARAMS
    ignored = 48 * 2 * HIDDEN * 48  # in_proj_b and in_proj_a of each DeltaNet layer
    tables = 2 * 248_320 * HIDDEN  # the embedding and the untied LM head
    assert tables + ignored < weights.counts.total < tables + ignored + 10_000_000  # + norms, conv, decays
    gib = (weights.counts.total * 2 + weights.stored_bytes) / 2**30
    assert 17.4 < gib < 17.6


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_the_27b_awq_model_builds_with_its_ignore_list(tensor_parallel_size):
    """Built on the meta device (no 27B allocation): layer 0's in_proj_b and in_proj_a stay 16-bit (the
    ignore list names model.language_model.layers.0.linear_attn.in_proj_b), its in_proj_qkv and every
    other projection are int4, the LM head 16-bit; at TP 2 every rank's row-parallel input is whole groups
    of 32."""
    need(AWQ_27B)
    config = CheckpointConfig.from_folder(AWQ_27B)
    with on_rank(tensor_parallel_size - 1, tensor_parallel_size), torch.device("meta"):
        model = get_model_class(config)(config)
    first, full = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    for layer in (first.in_proj_b, first.in_proj_a, model.lm_head):
        assert isinstance(getattr(layer, "linear_method", UnquantizedLinearMethod()), UnquantizedLinearMethod)
    int4 = (first.in_proj_qkv, first.in_proj_z, first.out_proj, full.q_proj, full.k_proj, full.o_proj)
    int4 += (model.model.layers[0].mlp.gate_up_proj, model.model.layers[63].mlp.down_proj)
    assert all(isinstance(layer.linear_method, Int4LinearMethod) for layer in int4)
    methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
    assert sum(isinstance(method, Int4LinearMethod) for method in methods) == 16 * 6 + 48 * 5
    assert first.out_proj.input_size_per_rank == 6144 // tensor_parallel_size


def test_an_int4_moe_is_planned_with_its_experts_int4(tmp_path):
    """Qwen3.6-35B-A3B's config with the 27B's quantization_config (compressed-tensors int4, groups of 32):
    the engine's plan check takes it (its experts run int4, layers/moe_int4.py) and counts every expert
    and the shared expert as int4; --quantization bitsandbytes on the 16-bit MoE is refused naming what
    runs."""
    need(MOE)
    need(AWQ_27B)
    raw = json.loads((MOE / "config.json").read_text())
    raw["quantization_config"] = json.loads((AWQ_27B / "config.json").read_text())["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = inspect_model(str(tmp_path), load_format="dummy")
    fmt = check_quantized_checkpoint(model, None)
    quantized = qwen3_5_quantized(fmt, model.hf_config)
    text = raw["text_config"]
    layers, experts = text["num_hidden_layers"], text["num_experts"]
    expert_names = [n for n in quantized if ".mlp.experts." in n]
    assert len(expert_names) == 3 * layers * experts
    assert quantized["model.language_model.layers.0.mlp.experts.255.down_proj"] == (
        text["moe_intermediate_size"],
        text["hidden_size"],
    )
    assert "model.language_model.layers.0.mlp.shared_expert.gate_proj" in quantized
    assert not [n for n in quantized if n.endswith((".mlp.gate", "shared_expert_gate"))]
    with pytest.raises(
        ValueError,
        match=r"Qwen3\.5 MoE model \(Qwen3_5MoeForConditionalGeneration, 256 experts\).*not this format",
    ):
        check_quantized_checkpoint(inspect_model(str(MOE), load_format="dummy"), "bitsandbytes")
