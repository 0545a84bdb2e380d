"""Weight sizes from file headers, against the tensors actually in the files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from fitserve.planner.memory import plan_memory
from fitserve.planner.memory_estimates import weight_bytes_total
from fitserve.planner.model_info import inspect_model
from fitserve.planner.model_shape import ModelShape
from fitserve.planner.weights import (
    classify_tensor,
    inventory_from_folder,
    inventory_from_gguf,
)
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.planner_helpers import memory_inputs

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (q/k/v biases, untied head) saved by transformers as safetensors in bf16."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model = build_hf_model(tiny_hf_config("Qwen2ForCausalLM", tie_word_embeddings=False), seed=1)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_safetensors_header_counts_the_files_tensors(tiny_qwen2_folder: Path) -> None:
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_qwen2_folder))
    inventory = inventory_from_folder(tiny_qwen2_folder, shape)
    tensors = _tensors(tiny_qwen2_folder)
    assert inventory.total_params == sum(t.numel() for t in tensors.values())
    assert inventory.file_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    linear = sum(
        t.numel() for name, t in tensors.items() if any(p in name for p in _PROJECTIONS) and t.ndim == 2
    )
    assert inventory.counts.linear == linear
    norms = sum(t.numel() for name, t in tensors.items() if "norm" in name)
    assert inventory.counts.replicated == norms
    assert inventory.source == "safetensors headers (1 file)"
    assert inventory.file_tensor_types == ("BF16",)
    # the config's shapes give the same counts as the file's header
    assert shape.parameter_counts() == inventory.counts


def test_sharded_checkpoint_and_index_only(tiny_qwen2_folder: Path, tmp_path: Path) -> None:
    model = build_hf_model(tiny_hf_config("Qwen2ForCausalLM", tie_word_embeddings=False), seed=1)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # float32 shards with an index
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tmp_path))
    sharded = inventory_from_folder(tmp_path, shape)
    single = inventory_from_folder(tiny_qwen2_folder, shape)
    assert sharded.counts == single.counts  # same parameters, float32 files
    assert sharded.file_bytes == 2 * single.file_bytes
    assert sharded.source == f"safetensors headers ({len(shards)} files)"

    shards[0].unlink()  # a partial download: only the index's total_size is known
    index_only = inventory_from_folder(tmp_path, shape)
    total_size = json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert index_only.file_bytes == total_size
    assert index_only.counts == shape.parameter_counts()
    assert "index.json only" in index_only.source


def test_weights_in_memory_are_counted_in_the_model_dtype(tmp_path: Path) -> None:
    model = build_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=2)
    model.save_pretrained(tmp_path)  # float32 file
    info = inspect_model(str(tmp_path))
    inputs = memory_inputs("llama-3.1-8b", shape=info.shape, weights=info.weights, dtype="bfloat16")
    assert weight_bytes_total(inputs) * 2 == info.weights.file_bytes
    assert plan_memory(inputs).terms.weights == sum(p.numel() for p in model.parameters()) * 2


def test_already_quantized_tensors_count_as_stored(tmp_path: Path) -> None:
    config = tiny_hf_config("LlamaForCausalLM")
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 64}
    config.save_pretrained(tmp_path)
    tensors = {
        "model.embed_tokens.weight": torch.zeros(256, 64, dtype=torch.float16),
        "model.layers.0.self_attn.q_proj.qweight": torch.zeros(64, 8, dtype=torch.int32),
        "model.layers.0.self_attn.q_proj.qzeros": torch.zeros(1, 8, dtype=torch.int32),
        "model.layers.0.self_attn.q_proj.scales": torch.zeros(1, 64, dtype=torch.float16),
        "model.norm.weight": torch.ones(64, dtype=torch.float16),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    info = inspect_model(str(tmp_path))
    assert info.weights.checkpoint_quantization == "awq"
    # packed codes and zeros (int32) and the float16 scales, as stored
    assert info.weights.stored_bytes == (64 * 8 + 8) * 4 + 64 * 2
    inputs = memory_inputs(
        "llama-3.1-8b", shape=info.shape, weights=info.weights, dtype="bfloat16", quantization="awq"
    )
    float_params = 256 * 64 + 64
    assert weight_bytes_total(inputs) == (64 * 8 + 8) * 4 + 64 * 2 + float_params * 2


def _write_gguf(path: Path) -> dict[str, tuple[int, int]]:
    """A small llama-named GGUF of F32, F16 and Q8_0 tensors; returns name -> (elements, stored bytes)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    rng = np.random.default_rng(0)
    expected: dict[str, tuple[int, int]] = {}
    tensors = {
        "token_embd.weight": (rng.standard_normal((64, 32)).astype(np.float16), None),
        "blk.0.attn_norm.weight": (np.ones(32, dtype=np.float32), None),
        "blk.0.attn_q.weight": (
            rng.standard_normal((32, 32)).astype(np.float32),
            gguf.GGMLQuantizationType.Q8_0,
        ),
        "blk.0.ffn_down.weight": (
            rng.standard_normal((32, 64)).astype(np.float32),
            gguf.GGMLQuantizationType.Q8_0,
        ),
        "output_norm.weight": (np.ones(32, dtype=np.float32), None),
    }
    for name, (array, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, array)
            expected[name] = (array.size, array.nbytes)
        else:
            packed = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            expected[name] = (array.size, packed.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_gguf_header_counts_elements_and_stored_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path)
    inventory = inventory_from_gguf(path)
    assert inventory.file_bytes == sum(nbytes for _, nbytes in expected.values())
    assert inventory.total_params == sum(n for n, _ in expected.values())
    assert (
        inventory.counts.linear == expected["blk.0.attn_q.weight"][0] + expected["blk.0.ffn_down.weight"][0]
    )
    assert inventory.counts.replicated == 64
    assert set(inventory.file_tensor_types) == {"F16", "F32", "Q8_0"}
    # Q8_0 stores 34 bytes per 32 weights
    assert expected["blk.0.attn_q.weight"][1] == 32 * 32 // 32 * 34


def test_default_model_gguf_when_present() -> None:
    """The default model's Q4_1 GGUF, if a previous run fetched it into fitserve's cache."""
    cache = Path(os.environ.get("FITSERVE_CACHE_DIR", Path.home() / ".cache" / "fitserve"))
    found = sorted(cache.glob("**/SmolLM2-135M-Instruct*.gguf"))
    if not found:
        pytest.skip(f"no SmolLM2 GGUF under {cache}")
    inventory = inventory_from_gguf(found[0])
    assert inventory.total_params == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M, tied embeddings
    assert "Q4_1" in inventory.file_tensor_types
    # the tensor data is nearly all of the file: the rest is metadata (the tokenizer) and alignment
    file_size = found[0].stat().st_size
    assert inventory.file_bytes is not None and 0.9 * file_size < inventory.file_bytes < file_size


@pytest.mark.parametrize(
    ("name", "ndim", "kind"),
    [
        ("model.layers.3.self_attn.q_proj.weight", 2, "linear"),
        ("model.layers.3.mlp.experts.7.down_proj.weight", 2, "linear"),
        ("model.layers.3.mlp.gate.weight", 2, "replicated"),
        ("model.layers.3.input_layernorm.weight", 1, "replicated"),
        ("model.layers.3.self_attn.q_proj.bias", 1, "other"),
        ("model.embed_tokens.weight", 2, "other"),
        ("lm_head.weight", 2, "other"),
        ("blk.0.ffn_gate_exps.weight", 3, "linear"),
        ("blk.0.ffn_gate_inp.weight", 2, "replicated"),
        ("output.weight", 2, "other"),
    ],
)
def test_tensor_classes(name: str, ndim: int, kind: str) -> None:
    assert classify_tensor(name, ndim) == kind


def test_truncated_safetensors_is_refused_naming_the_file(tmp_path: Path) -> None:
    tiny_hf_config("LlamaForCausalLM").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(
        ValueError, match=r"model.safetensors is (truncated|corrupt).*download the model again"
    ):
        inspect_model(str(tmp_path))


def test_hub_id_without_hub_or_cache_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(
        ValueError, match=r"cannot read config.json of 'someorg/some-model': .*download the model"
    ):
        inspect_model("someorg/some-model")
    with pytest.raises(ValueError, match=r"model path ./missing-folder does not exist"):
        inspect_model("./missing-folder")


def test_a_q4_conversion_is_planned_as_the_cpu_engine_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder converted from a Q4_1 GGUF (its cache record names the file): on the CPU the decoder
    matrices count as int4 and the LM head gets its float16 copy; on a GPU everything is the dtype."""
    build_hf_model(tiny_hf_config("LlamaForCausalLM"), seed=3).to(torch.bfloat16).save_pretrained(tmp_path)
    (tmp_path / "fitserve_cache_entry.json").write_text(json.dumps({"source_gguf": "/d/Tiny.Q4_1.gguf"}))
    info = inspect_model(str(tmp_path))
    forms, counts = info.weights.cpu_forms, info.weights.counts
    assert forms.gguf_type == "Q4_1" and forms.int4_params == counts.linear > 0 and forms.fp16_head
    assert info.weights.source == "safetensors headers (1 file); converted from a Q4_1 GGUF"
    cpu = memory_inputs(
        "llama-3.1-8b", shape=info.shape, weights=info.weights, dtype="float32", cudagraph_capture_sizes=()
    )
    cpu = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, kind="cpu", name="CPU"))
    head = info.shape.vocab_size * info.shape.hidden_size
    int4 = counts.linear * forms.int4_bytes_per_weight
    assert weight_bytes_total(cpu) == math.ceil(int4) + counts.other * 4 + head * 2
    gpu = memory_inputs("llama-3.1-8b", shape=info.shape, weights=info.weights, dtype="bfloat16")
    assert weight_bytes_total(gpu) == counts.total * 2  # the GPU engine dequantizes every matrix
    monkeypatch.setenv("FITSERVE_CPU_INT4", "0")  # the engine then keeps every matrix float
    assert inspect_model(str(tmp_path)).weights.cpu_forms.int4_params == 0
