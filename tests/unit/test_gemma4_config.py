"""Gemma-4's config.json read by fitserve itself, and the plan of the four released models.

The real files are ../shared/models/gemma-4-* (shared/models/README.md: 31B = 30.7 B parameters, 26B-A4B =
25.2 B with 3.8 B active). The numbers below were worked out by hand from those files' text_config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from fitserve.cli.plan import run_plan
from fitserve.kv_layers import FULL, SLIDING, kv_elements_per_token, kv_layer_specs
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.gemma4_config import GEMMA4_TEXT_DEFAULTS
from fitserve.models.loader import load_hf_config
from fitserve.models.registry import get_model_class
from fitserve.planner.model_shape import ModelShape
from tests.paths import MODELS_DIR
from tests.unit.test_planner_cli import parse

MODELS = {name: MODELS_DIR / f"gemma-4-{name}" for name in ("e2b-it", "e4b-it", "26b-a4b-it", "31b-it")}
# bf16 KV bytes per token: 2 (K, V) x 2 bytes x sum over the layers that own a cache of heads x head_dim
KV_BYTES = {
    # 35 layers, 20 KV-shared: the first 15 own a cache, 12 sliding (1 x 256) and 3 full (1 x 512)
    "e2b-it": 4 * (12 * 256 + 3 * 512),  # 18,432
    # 42 layers, 18 KV-shared: 24 own a cache, 20 sliding (2 x 256) and 4 full (2 x 512)
    "e4b-it": 4 * (20 * 2 * 256 + 4 * 2 * 512),  # 57,344
    # 30 layers: 25 sliding (8 x 256), 5 full with attention_k_eq_v (num_global_key_value_heads 2 x 512)
    "26b-a4b-it": 4 * (25 * 8 * 256 + 5 * 2 * 512),  # 225,280
    # 60 layers: 50 sliding (16 x 256), 10 full (4 x 512)
    "31b-it": 4 * (50 * 16 * 256 + 10 * 4 * 512),  # 901,120
}
TOWERS = {
    "e2b-it": ["vision", "audio"],
    "e4b-it": ["vision", "audio"],
    "26b-a4b-it": ["vision"],
    "31b-it": ["vision"],
}
PARAMS = {  # text model only; the towers are not loaded
    "e2b-it": 4_628_569_379,
    "e4b-it": 7_463_013_418,
    "26b-a4b-it": 25_233_141_790,
    "31b-it": 30_697_345_340,
}


def test_31b_parameter_count_by_hand():
    """hidden 5376, 60 layers (50 sliding, 10 full), 32 heads, MLP 21504, vocab 262144 tied."""
    hidden, mlp = 5376, 3 * 5376 * 21504
    sliding = 2 * hidden * 32 * 256 + 2 * hidden * 16 * 256 + mlp + (2 * 256 + 4 * hidden + 1)
    full = 2 * hidden * 32 * 512 + hidden * 4 * 512 + mlp + (2 * 512 + 4 * hidden + 1)  # K=V: no v_proj
    total = 50 * sliding + 10 * full + 262144 * hidden + hidden
    assert total == PARAMS["31b-it"]
    assert round(total / 1e9, 1) == 30.7


@pytest.mark.parametrize("name", list(MODELS))
def test_real_configs_are_read_without_transformers(name):
    config = load_hf_config(str(MODELS[name]))
    assert isinstance(config, CheckpointConfig)
    assert config.towers == TOWERS[name] and config.weights_prefix == "model.language_model."
    specs = kv_layer_specs(config)
    assert len(specs) == config.num_hidden_layers
    assert kv_elements_per_token(specs) * 2 == KV_BYTES[name]
    shape = ModelShape.from_hf_config(config)
    assert shape.parameter_counts().total == PARAMS[name]
    assert shape.kv_elements_per_token() * 2 == KV_BYTES[name]


def test_26b_moe_active_parameters():
    shape = ModelShape.from_hf_config(load_hf_config(str(MODELS["26b-a4b-it"])))
    experts = 30 * 128 * 3 * 704 * 2816  # every layer: 128 experts of 704
    assert shape.active_params == PARAMS["26b-a4b-it"] - experts + experts * 8 // 128
    assert round(shape.active_params / 1e9, 1) == 3.8
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (128, 8, 704)


def test_e2b_kv_sharing_reads_the_last_layer_of_each_type():
    specs = kv_layer_specs(load_hf_config(str(MODELS["e2b-it"])))
    assert [s.cache_layer for s in specs[15:20]] == [13, 13, 13, 13, 14]  # layer 14 is the last full one
    assert specs[4].layer_type == FULL and (specs[4].num_kv_heads, specs[4].head_dim) == (1, 512)
    assert specs[0].layer_type == SLIDING and specs[0].sliding_window == 512


@pytest.mark.parametrize("name", list(MODELS))
def test_plan_counts_kv_per_layer_type(name, capsys):
    status = run_plan(parse("plan", [str(MODELS[name]), "--assume-gpus", "1x80", "--json"]))
    plan = json.loads(capsys.readouterr().out)
    assert status == 0
    assert plan["kv_bytes_per_token"] == KV_BYTES[name]
    assert plan["model"]["parameters"] == PARAMS[name]
    assert plan["model"]["towers_not_loaded"] == TOWERS[name]
    run_plan(parse("plan", [str(MODELS[name]), "--assume-gpus", "1x80"]))
    text = capsys.readouterr().out
    assert f"the {' and '.join(TOWERS[name])} tower(s) are not loaded" in text
    assert "sliding layers" in text and "full layers" in text


def test_defaults_agree_with_transformers():
    reference = transformers.Gemma4TextConfig().to_dict()  # head_dim is "per-layer" as an attribute
    skipped = {
        "model_type",
        "global_head_dim",
        "num_global_key_value_heads",
        "layer_types",
        "rope_parameters",
    }
    for key, value in GEMMA4_TEXT_DEFAULTS.items():
        if key not in skipped:
            assert reference[key] == value, key


def test_released_and_resaved_forms_agree(tmp_path):
    """transformers >= 5.x re-saves global_head_dim / num_global_key_value_heads as per_layer_config."""
    resaved = tmp_path / "resaved"
    transformers.AutoConfig.from_pretrained(MODELS["26b-a4b-it"]).save_pretrained(resaved)
    assert "per_layer_config" in json.loads((resaved / "config.json").read_text())["text_config"]
    released = kv_layer_specs(load_hf_config(str(MODELS["26b-a4b-it"])))
    assert kv_layer_specs(load_hf_config(str(resaved))) == released


def write_config(folder: Path, **changes) -> Path:
    raw = json.loads((MODELS["e2b-it"] / "config.json").read_text())
    raw["text_config"].update(changes.pop("text", {}))
    raw.update(changes)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_refusals_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'.*set it to null"):
        load_hf_config(str(write_config(tmp_path / "a", text={"use_bidirectional_attention": "all"})))
    no_text = write_config(tmp_path / "b")
    raw = json.loads((no_text / "config.json").read_text())
    del raw["text_config"]
    (no_text / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no text_config"):
        load_hf_config(str(no_text))
    config = load_hf_config(str(write_config(tmp_path / "c", text={"num_kv_shared_layers": 35})))
    with pytest.raises(ValueError, match="num_kv_shared_layers=35 with 35 layers"):
        kv_layer_specs(config)


def test_e2b_builds_on_the_meta_device_with_the_planned_parameters():
    """--load-format dummy's model for the real E2B config: built on the meta device (no memory), every
    parameter the plan counts, the layers' attention geometry as the config says."""
    config = load_hf_config(str(MODELS["e2b-it"]))
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert sum(p.numel() for p in model.parameters()) == PARAMS["e2b-it"]
    attentions = model.attention_layers
    assert [a.head_dim for a in attentions[:5]] == [256, 256, 256, 256, 512]
    assert sum(a.kv_cache_layer != a.layer_idx for a in attentions) == 20
    assert model.model.layers[20].mlp.down_proj.input_size == 2 * 6144  # double-wide on shared layers


TEXT_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_activation",
    "max_position_embeddings",
    "rms_norm_eps",
    "layer_types",
    "sliding_window",
    "rope_parameters",
    "final_logit_softcapping",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "enable_moe_block",
    "use_double_wide_mlp",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "attention_bias",
]


@pytest.mark.parametrize("name", list(MODELS))
def test_real_configs_read_like_autoconfig(name):
    """Every text key fitserve reads has transformers' value (its text_config, as a dict: some of its
    attributes refuse global reads), and the per-layer geometry is the one its per_layer_config holds."""
    ours = load_hf_config(str(MODELS[name]))
    theirs = transformers.AutoConfig.from_pretrained(MODELS[name]).text_config.to_dict()
    for key in TEXT_KEYS:
        assert getattr(ours, key) == theirs[key], key
    for index, spec in enumerate(kv_layer_specs(ours)):
        override = theirs["per_layer_config"].get(f"{index:02d}") or theirs["per_layer_config"].get(
            str(index), {}
        )
        assert spec.head_dim == override.get("head_dim", theirs["head_dim"])
        assert spec.num_kv_heads == override.get("num_key_value_heads", theirs["num_key_value_heads"])


def test_quantization_is_honoured_not_ignored(tmp_path):
    """A quantization_config builds the format's layers (tests/unit/test_gemma4_quant*.py load them)."""
    from fitserve.layers.quantization.fp8_method import Fp8LinearMethod

    folder = write_config(tmp_path / "q", quantization_config={"quant_method": "fp8"})
    config = load_hf_config(str(folder))
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.linear_method, Fp8LinearMethod)
