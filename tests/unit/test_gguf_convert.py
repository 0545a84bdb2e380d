"""GGUF -> cached HF folder: a tiny Llama written to GGUF with the `gguf` package's writer (F32 tensors,
llama.cpp's q/k row order, a byte-level BPE tokenizer with a chat template) must come back as a folder
whose model gives the original's logits and whose tokenizer encodes as the original did; the cache is
reused, keyed by the file's identity and dtype, and published atomically.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM

from fitserve.models.gguf_convert import gguf_cache_folder
from fitserve.models.loader import (
    load_generation_defaults,
    load_hf_config,
    load_model,
    load_tokenizer,
    model_max_length,
    resolve_model,
)
from fitserve.models.model_cache import COMPLETE_MARKER, publish_folder
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config
from tests.unit.test_loader import model_config_for

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 320
SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog, 42 times!\nThen it rests."


def train_tiny_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        SAMPLE_TEXT,
        "the theory of the thing is that these then there",
        "brown foxes jump; lazy dogs sleep",
    ]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer


def llama_cpp_row_order(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores q/k rows of each head as (first halves, second halves) interleaved pairwise."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_tiny_llama_gguf(path: Path, hf_model: torch.nn.Module, tokenizer: Tokenizer) -> None:
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 0.95)

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in hf_model.state_dict().items():
        if ".q_proj." in hf_name:
            tensor = llama_cpp_row_order(tensor, config.num_attention_heads)
        elif ".k_proj." in hf_name:
            tensor = llama_cpp_row_order(tensor, config.num_key_value_heads)
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight",))
        writer.add_tensor(gguf_name, tensor.to(torch.float32).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Tokenizer]:
    tokenizer = train_tiny_tokenizer()
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", vocab_size=VOCAB_SIZE), seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_tiny_llama_gguf(path, hf_model, tokenizer)
    return path, hf_model, tokenizer


@pytest.fixture
def cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("FITSERVE_CACHE_DIR", str(tmp_path / "fitserve-cache"))
    return tmp_path / "fitserve-cache"


def test_converted_folder_reproduces_model_and_tokenizer(
    tiny_gguf: tuple[Path, Any, Any], cache_dir: Path
) -> None:
    path, hf_model, tokenizer = tiny_gguf
    resolved = resolve_model(str(path))
    folder = Path(resolved.model_path)
    assert folder.parent == cache_dir / "converted" and resolved.tokenizer_path == str(folder)
    assert "converted now" in resolved.source

    hf_config = load_hf_config(str(folder))
    assert hf_config.architectures == ["LlamaForCausalLM"] and hf_config.dtype == torch.float32
    assert model_max_length(hf_config) == hf_model.config.max_position_embeddings
    prompt = tokenizer.encode(SAMPLE_TEXT).ids
    expected = hf_logits(hf_model, prompt)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(reloaded, prompt), expected, atol=1e-5, rtol=1e-5)
    model = load_model(model_config_for(folder), "cpu")
    ours = PagedTestRunner(model, hf_config).step([("seq", prompt)])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)

    converted_tokenizer = load_tokenizer(resolved.tokenizer_path)
    assert converted_tokenizer(SAMPLE_TEXT).input_ids == prompt
    messages = [{"role": "user", "content": "hi"}]
    rendered = converted_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert converted_tokenizer.eos_token == "<|im_end|>"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert load_generation_defaults(str(folder)) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_second_resolve_reuses_the_cache(
    tiny_gguf: tuple[Path, Any, Any], cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_gguf[0]
    with caplog.at_level(logging.INFO, logger="fitserve"):
        first = resolve_model(str(path))
    conversion_logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Converted GGUF")]
    assert len(conversion_logs) == 1 and first.model_path in conversion_logs[0]
    marker = Path(first.model_path) / COMPLETE_MARKER
    marker_stat = marker.stat()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fitserve"):
        second = resolve_model(str(path))
    assert second.model_path == first.model_path and "converted earlier" in second.source
    assert not [r for r in caplog.records if r.getMessage().startswith("Convert")]
    assert (marker.stat().st_mtime_ns, marker.stat().st_ino) == (marker_stat.st_mtime_ns, marker_stat.st_ino)
    entries = [p.name for p in (cache_dir / "converted").iterdir() if p.is_dir()]
    assert entries == [Path(first.model_path).name]


def test_concurrent_starts_convert_once(
    tiny_gguf: tuple[Path, Any, Any], cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fitserve"), ThreadPoolExecutor(max_workers=3) as pool:
        folders = list(pool.map(lambda _: resolve_model(str(tiny_gguf[0])).model_path, range(3)))
    assert len(set(folders)) == 1
    assert len([r for r in caplog.records if r.getMessage().startswith("Converted GGUF")]) == 1


def test_cache_key_follows_file_identity_and_dtype(tiny_gguf: tuple[Path, Any, Any], cache_dir: Path) -> None:
    path = tiny_gguf[0]
    auto_folder = resolve_model(str(path)).model_path
    half = resolve_model(str(path), dtype="float16")
    assert half.model_path != auto_folder and half.model_path.endswith("-float16")
    assert load_hf_config(half.model_path).dtype == torch.float16
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        assert gguf_cache_folder(path, None) != Path(auto_folder)
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ValueError, match="dtype='int8' is not a GGUF conversion dtype: use auto, float32"):
        resolve_model(str(path), dtype="int8")


def test_file_that_is_not_gguf_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>404 not found</html>")
    with pytest.raises(ValueError, match=rf"{fake} is not a GGUF file \(it starts with b'<htm'"):
        resolve_model(str(fake))
    converted = cache_dir / "converted"
    assert not converted.exists() or not [p for p in converted.iterdir() if p.is_dir()]


def test_interrupted_publish_leaves_no_cache_entry(tmp_path: Path) -> None:
    target = tmp_path / "converted" / "entry"
    with pytest.raises(RuntimeError, match="interrupted"), publish_folder(target, {"k": 1}) as staging:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("interrupted")
    assert not target.exists() and not list(target.parent.iterdir())

    abandoned = target.parent / "entry.partial-999999999-deadbeef"  # its writer (no such pid) is gone
    abandoned.mkdir()
    with publish_folder(target, {"k": 2}) as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(p.name for p in target.parent.iterdir()) == ["entry"]
    assert json.loads((target / COMPLETE_MARKER).read_text()) == {"k": 2}


def test_conversion_parses_the_file_once_and_records_its_matrix_types(
    tiny_gguf: tuple[Path, Any, Any], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers opens the file for the config, the tokenizer and the weights; gguf-py parses all of
    its metadata at each open, so the conversion hands every one of them the same parsed reader."""
    parses: list[str] = []
    real_reader = gguf.GGUFReader

    def counting_reader(path: Any, mode: str = "r") -> Any:
        parses.append(str(path))
        return real_reader(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    name_map = gguf.get_tensor_name_map
    folder = Path(resolve_model(str(tiny_gguf[0])).model_path)
    assert parses == [str(tiny_gguf[0].resolve())]
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is name_map  # put back
    record = json.loads((folder / COMPLETE_MARKER).read_text())
    assert record["gguf_matrix_types"] == {"F32": 16}  # 2 layers x 7 projections, embedding, LM head
