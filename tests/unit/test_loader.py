"""fitserve.models.loader: folders, safetensors (single, sharded, damaged), dummy weights, config helpers.

Checkpoints are tiny random HF models written by transformers' own save_pretrained; a loaded model must
give HF's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from fitserve.config import ModelConfig
from fitserve.models.loader import (
    load_generation_defaults,
    load_hf_config,
    load_model,
    load_tokenizer,
    model_max_length,
    resolve_model,
)
from fitserve.models.weights import iterate_safetensors, list_safetensors_files
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config

PROMPT_IDS = [3, 17, 101, 5, 250, 42, 7, 99, 180, 33]


def save_tiny_llama(folder: Path, max_shard_size: str | None = None) -> torch.nn.Module:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(folder, **kwargs)
    return hf_model


def model_config_for(folder: Path, dtype: torch.dtype = torch.float32, **overrides: Any) -> ModelConfig:
    hf_config = load_hf_config(str(folder))
    fields: dict[str, Any] = {
        "model": str(folder),
        "model_path": str(folder),
        "model_source": f"local folder {folder}",
        "tokenizer": str(folder),
        "hf_config": hf_config,
        "dtype": dtype,
        "max_model_len": model_max_length(hf_config),
    }
    return ModelConfig(**{**fields, **overrides})


def fitserve_logits(model: torch.nn.Module, hf_config: Any, token_ids: list[int]) -> torch.Tensor:
    return PagedTestRunner(model, hf_config).step([("seq", token_ids)])[0]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_llama(folder)


@pytest.fixture(scope="module")
def tiny_llama_sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("tiny-llama-sharded")
    return folder, save_tiny_llama(folder, max_shard_size="60KB")


@pytest.mark.parametrize("fixture_name", ["tiny_llama", "tiny_llama_sharded"])
def test_safetensors_iteration_gives_the_saved_state(
    fixture_name: str, request: pytest.FixtureRequest
) -> None:
    folder, hf_model = request.getfixturevalue(fixture_name)
    files = list_safetensors_files(str(folder))
    if fixture_name == "tiny_llama_sharded":
        assert len(files) > 2 and (folder / "model.safetensors.index.json").is_file()
    loaded = dict(iterate_safetensors(files))
    expected = hf_model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("fixture_name", ["tiny_llama", "tiny_llama_sharded"])
def test_loaded_model_gives_hf_logits(fixture_name: str, request: pytest.FixtureRequest) -> None:
    folder, hf_model = request.getfixturevalue(fixture_name)
    resolved = resolve_model(str(folder))
    assert resolved.model_path == str(folder.resolve()) and not resolved.is_default
    config = model_config_for(Path(resolved.model_path))
    model = load_model(config, torch.device("cpu"))
    expected = hf_logits(hf_model, PROMPT_IDS)
    torch.testing.assert_close(
        fitserve_logits(model, config.hf_config, PROMPT_IDS), expected, atol=1e-4, rtol=1e-4
    )


def test_load_model_builds_in_the_config_dtype_and_restores_the_default(tiny_llama: tuple[Path, Any]) -> None:
    folder, _ = tiny_llama
    before = torch.get_default_dtype()
    model = load_model(model_config_for(folder, dtype=torch.bfloat16), "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == before
    assert not model.training


def test_missing_path_is_refused_with_the_accepted_forms(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    expected = (
        f"model path {missing} does not exist: pass a local folder with config.json, a .gguf file or a "
        "Hugging Face id"
    )
    with pytest.raises(ValueError, match=expected):
        resolve_model(str(missing))
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(str(missing))


def test_folder_without_config_json_lists_its_contents(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"has no config.json \(it holds: model.safetensors, notes.txt\)"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="pass the file itself, e.g. --model .*weights.Q4_K_M.gguf"):
        load_hf_config(str(tmp_path))


def copy_checkpoint(source: Path, target: Path) -> None:
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())


def test_truncated_safetensors_is_named_and_refused(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    copy_checkpoint(tiny_llama[0], folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        ValueError, match=rf"safetensors file {weights} is truncated.*download the model again"
    ):
        load_model(model_config_for(folder), "cpu")
    weights.write_bytes(data[:5])
    with pytest.raises(ValueError, match="is truncated"):
        load_model(model_config_for(folder), "cpu")


def test_corrupt_safetensors_header_is_named_and_refused(
    tiny_llama: tuple[Path, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    copy_checkpoint(tiny_llama[0], folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"#not json!#!"
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"safetensors file {weights} is corrupt.*download the model again"):
        load_model(model_config_for(folder), "cpu")
    data[:8] = (2**40).to_bytes(8, "little")
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupt: its header length"):
        load_model(model_config_for(folder), "cpu")


def test_missing_parameters_are_named(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    copy_checkpoint(tiny_llama[0], folder)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"no weights for 1 parameter\(s\).*model.layers.1.post_attention_layernorm"
    ):
        load_model(model_config_for(folder), "cpu")


def test_index_naming_an_absent_shard_is_refused(
    tiny_llama_sharded: tuple[Path, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    copy_checkpoint(tiny_llama_sharded[0], folder)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"names 1 shard\(s\) that are not in .*{shard.name}"):
        load_model(model_config_for(folder), "cpu")


def test_folder_without_safetensors_says_what_it_has(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    copy_checkpoint(tiny_llama[0], folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*.safetensors weights \(it has pytorch_model.bin, which"):
        load_model(model_config_for(folder), "cpu")
    with pytest.raises(ValueError, match="load_format='pt' is not supported: use one of auto, safetensors"):
        load_model(model_config_for(folder, load_format="pt"), "cpu")


def test_dummy_weights_read_no_files_and_give_finite_seeded_logits(tmp_path: Path) -> None:
    hf_config = tiny_hf_config("LlamaForCausalLM")
    hf_config.save_pretrained(tmp_path)  # config.json only: nothing to read weights from
    config = model_config_for(tmp_path, load_format="dummy", seed=7)
    model = load_model(config, "cpu")
    logits = fitserve_logits(model, config.hf_config, PROMPT_IDS)
    assert torch.isfinite(logits).all()
    assert 1e-3 < logits.std().item() < 10.0
    norms = [p for name, p in model.named_parameters() if p.ndim == 1 and name.endswith("weight")]
    assert norms and all(torch.all(p == 1.0) for p in norms)
    same_seed = fitserve_logits(load_model(config, "cpu"), config.hf_config, PROMPT_IDS)
    other_seed = fitserve_logits(
        load_model(model_config_for(tmp_path, load_format="dummy", seed=8), "cpu"),
        config.hf_config,
        PROMPT_IDS,
    )
    assert torch.equal(logits, same_seed)
    assert not torch.allclose(logits, other_seed)


def test_model_max_length_counts_rope_extension() -> None:
    assert model_max_length(LlamaConfig(max_position_embeddings=4096)) == 4096
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert model_max_length(LlamaConfig(max_position_embeddings=40960, rope_scaling=yarn)) == 131072
    linear = {"rope_type": "linear", "factor": 2.0}
    assert model_max_length(LlamaConfig(max_position_embeddings=4096, rope_scaling=linear)) == 8192
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert model_max_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3)) == 131072


def test_generation_defaults_use_sampling_params_names(tmp_path: Path) -> None:
    assert load_generation_defaults(str(tmp_path)) == {}
    file = tmp_path / "generation_config.json"
    file.write_text(
        json.dumps(
            {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": None, "max_new_tokens": 64}
        )
    )
    assert load_generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 64}
    file.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{file} is not valid JSON"):
        load_generation_defaults(str(tmp_path))


def test_tokenizer_folder_without_tokenizer_files_is_refused(tiny_llama: tuple[Path, Any]) -> None:
    with pytest.raises(ValueError, match=r"has none of tokenizer.json.*\(it holds: config.json"):
        load_tokenizer(str(tiny_llama[0]))


def test_hub_id_without_hub_or_cache_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        ValueError, match="HF_HUB_OFFLINE is set and the local Hugging Face cache has no copy"
    ):
        resolve_model("some-org/some-model")


def test_hub_id_is_served_from_the_local_hf_cache(
    tiny_llama: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--some-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    copy_checkpoint(tiny_llama[0], repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    resolved = resolve_model("some-org/tiny-llama")
    assert Path(resolved.model_path) == repo / "snapshots" / commit
    assert resolved.source.startswith("Hugging Face model some-org/tiny-llama")


def test_a_folder_without_tokenizer_files_stops_the_engine_start(
    tiny_llama: tuple[Path, Any], tmp_path: Path
) -> None:
    """The tokenizer loads on a thread beside the model; its error still stops the start, naming it."""
    from fitserve import LLM

    folder, _ = tiny_llama
    (tmp_path / "notes.txt").write_text("no tokenizer here")
    with pytest.raises(ValueError, match=r"tokenizer folder .* has none of .*\(it holds: notes.txt\)"):
        LLM(str(folder), tokenizer=str(tmp_path), device="cpu", num_gpu_blocks_override=8)
