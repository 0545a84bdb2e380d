"""CheckpointConfig reads config.json without transformers' model code; it must read what AutoConfig
reads, for every key fitserve uses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoConfig

from fitserve.models.checkpoint_config import FAMILY_DEFAULTS, CheckpointConfig
from fitserve.models.gemma4_config import GEMMA4_ARCHITECTURES
from fitserve.models.loader import load_hf_config, model_max_length
from fitserve.models.qwen3_5_config import QWEN3_5_ARCHITECTURES
from fitserve.planner.model_shape import ModelShape
from tests.paths import SHARED_DIR
from tests.unit.model_helpers import tiny_hf_config

CONFIG_CLASSES = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "MistralForCausalLM": transformers.MistralConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
}
READ_KEYS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "max_window_layers",
    "bos_token_id",
    "eos_token_id",
]


@pytest.mark.parametrize("architecture", list(FAMILY_DEFAULTS))
def test_family_defaults_are_transformers_defaults(architecture):
    reference = CONFIG_CLASSES[architecture]()
    for key, value in FAMILY_DEFAULTS[architecture].items():
        if key == "rope_theta":  # transformers >= 5 keeps it in rope_parameters
            expected = getattr(reference, "rope_theta", None) or reference.rope_parameters["rope_theta"]
        else:
            expected = getattr(reference, key)
        assert value == expected, f"{architecture}.{key}"


def _shared_folders(read_by_fitserve: bool):
    """The real config files in shared/models whose architecture CheckpointConfig reads with the family
    defaults (or that it leaves to transformers). Gemma-4's, read by gemma4_config.py into a flat text
    config, are tested in test_gemma4_config.py."""
    folders = sorted(p.parent for p in (SHARED_DIR / "models").glob("*/config.json"))
    architectures = {
        folder: json.loads((folder / "config.json").read_text()).get("architectures", [""])[0]
        for folder in folders
    }
    return [
        folder
        for folder in folders
        if architectures[folder] not in GEMMA4_ARCHITECTURES
        and architectures[folder] not in QWEN3_5_ARCHITECTURES  # read by qwen3_5_config.py
        and (architectures[folder] in FAMILY_DEFAULTS) == read_by_fitserve
    ]


@pytest.mark.parametrize("folder", _shared_folders(read_by_fitserve=True), ids=lambda p: p.name)
def test_real_configs_read_like_autoconfig(folder):
    ours, theirs = load_hf_config(str(folder)), AutoConfig.from_pretrained(folder)
    assert isinstance(ours, CheckpointConfig)
    for key in READ_KEYS:
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    assert model_max_length(ours) == model_max_length(theirs)
    assert ours.dtype == theirs.dtype
    assert ModelShape.from_hf_config(ours) == ModelShape.from_hf_config(theirs)


@pytest.mark.parametrize("folder", _shared_folders(read_by_fitserve=False), ids=lambda p: p.name)
def test_other_architectures_are_read_by_transformers(folder):
    """Qwen3.5/3.6 and the like (not run by fitserve yet) get transformers' own config."""
    config = load_hf_config(str(folder))
    assert not isinstance(config, CheckpointConfig)
    assert type(config) is type(AutoConfig.from_pretrained(folder))


@pytest.mark.parametrize("architecture", list(FAMILY_DEFAULTS))
def test_a_sparse_config_gets_the_family_defaults(tmp_path, architecture):
    full = tiny_hf_config(architecture)
    sparse = {
        "architectures": [architecture],
        "model_type": full.model_type,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(sparse))
    ours, theirs = load_hf_config(str(tmp_path)), AutoConfig.from_pretrained(tmp_path)
    for key in READ_KEYS:
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert ModelShape.from_hf_config(ours) == ModelShape.from_hf_config(theirs)


def test_remote_code_and_other_architectures_go_to_transformers(tmp_path):
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    assert CheckpointConfig.from_folder(tmp_path) is None
    assert isinstance(load_hf_config(str(tmp_path)), transformers.GPT2Config)
    remote = {"architectures": ["LlamaForCausalLM"], "auto_map": {"AutoConfig": "x.Y"}}
    (tmp_path / "config.json").write_text(json.dumps(remote))
    assert CheckpointConfig.from_folder(tmp_path) is None
