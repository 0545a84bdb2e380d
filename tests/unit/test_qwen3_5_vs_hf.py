"""Qwen3.5 models (fitserve/models/qwen3_5.py) against HF transformers' qwen3_5 / qwen3_5_moe: the config
reader, weight loading in all four checkpoint forms, and one whole-sequence forward's logits (longer than a
DeltaNet chunk of 64), all on tiny random models; the real Qwen3.6 configs where the shared models exist."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from fitserve.kv_layers import LINEAR, kv_layer_specs
from fitserve.layers.attention.metadata import forward_context
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from fitserve.planner.model_shape import ModelShape
from fitserve.worker.recurrent_state import state_bytes_per_slot
from tests.model_folders import save_with_tokenizer
from tests.paths import MODELS_DIR
from tests.unit.qwen3_5_helpers import build_hf, hf_logits, make_config

FORMS = ["dense-causal", "dense-conditional", "moe-causal", "moe-conditional"]


@pytest.fixture(scope="module", params=FORMS)
def saved(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    family, form = request.param.split("-")
    config = make_config(moe=family == "moe", conditional=form == "conditional")
    model = build_hf(config, seed=5)
    return save_with_tokenizer(model, tmp_path_factory.mktemp(request.param)), model


def load_fitserve(folder: Path, extra: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    config = CheckpointConfig.from_folder(folder)
    assert config is not None, "fitserve reads Qwen3.5 configs itself"
    model = get_model_class(config)(config).eval()
    tensors = load_file(folder / "model.safetensors")
    loaded = model.load_weights([*tensors.items(), *(extra or {}).items()])
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert not missing, f"parameters left unloaded: {sorted(missing)}"
    return model


def test_whole_forward_matches_hf(saved):
    folder, hf_model = saved
    # an MTP layer's tensors, as the published checkpoints carry them: skipped at load
    model = load_fitserve(folder, {"mtp.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4)})
    tokens = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), forward_context(None, []):
        logits = model.compute_logits(model(tokens, torch.arange(150)))
    reference = hf_logits(hf_model, tokens.tolist())
    assert (logits - reference).abs().max().item() < 1e-4 * max(1.0, reference.abs().max().item())


def test_config_is_flattened_and_layers_typed(saved):
    folder, _ = saved
    raw = json.loads((folder / "config.json").read_text())
    config = CheckpointConfig.from_folder(folder)
    assert config.hidden_size == 32 and config.linear_num_value_heads == 4
    assert config.weights_prefix == ("model.language_model." if "text_config" in raw else "model.")
    specs = kv_layer_specs(config)
    assert [spec.layer_type for spec in specs] == config.layer_types
    owners = [index for index, spec in enumerate(specs) if spec.owns_cache(index)]
    assert owners == [2]  # the one full-attention layer
    assert all(spec.layer_type == LINEAR for index, spec in enumerate(specs) if index != 2)


def test_parameter_count_matches_hf(saved):
    folder, hf_model = saved
    config = CheckpointConfig.from_folder(folder)
    shape = ModelShape.from_hf_config(config)
    text_params = sum(
        p.numel() for name, p in hf_model.named_parameters() if "visual" not in name and "mtp" not in name
    )
    assert shape.parameter_counts().total == text_params
    assert shape.state_bytes_per_seq(2) == state_bytes_per_slot(config, 2)


@pytest.mark.parametrize("name", ["qwen3.6-27b", "qwen3.6-35b-a3b"])
def test_real_configs(name):
    folder = MODELS_DIR / name
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} is not here")
    config = CheckpointConfig.from_folder(folder)
    assert config.architectures[0].endswith("ForConditionalGeneration")
    assert config.weights_prefix == "model.language_model." and config.towers == ["vision"]
    assert config.layer_types.count("full_attention") == config.num_hidden_layers // 4
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    shape = ModelShape.from_hf_config(config)
    billions = shape.parameter_counts().total / 1e9
    assert (26 < billions < 28) if name == "qwen3.6-27b" else (34 < billions < 36)
    # 48 (27B) or 30 (35B-A3B) DeltaNet layers, each 3 conv inputs and heads x 128 x 128 float32 states
    layers = config.num_hidden_layers * 3 // 4
    value_heads = config.linear_num_value_heads
    conv_dim = 2 * 16 * 128 + value_heads * 128
    assert state_bytes_per_slot(config, 2) == layers * (conv_dim * 3 * 2 + value_heads * 128 * 128 * 4)
    # transformers' reading of the same file gives the same shape (its text config has no `towers`)
    theirs = ModelShape.from_hf_config(AutoConfig.from_pretrained(folder))
    assert dataclasses.replace(theirs, towers=shape.towers) == shape
