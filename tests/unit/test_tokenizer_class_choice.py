"""load_tokenizer skips building the model's transformers config when tokenizer_config.json names its
class (loader._class_choice); the tokenizer must come out exactly as AutoTokenizer alone makes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fitserve.models.loader import _class_choice, load_tokenizer
from tests.model_folders import copy_smollm2_tokenizer

TEXT = "The capital of France is Paris. 17*23 = 391 <|im_end|> naïve 日本"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def tokenizer_folder(root: Path, model_type: str, tokenizer_class: str | None) -> Path:
    folder = root / f"{model_type}-{tokenizer_class}"
    folder.mkdir()
    copy_smollm2_tokenizer(folder, chat_template=True)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if tokenizer_class is None:
        settings.pop("tokenizer_class", None)
    else:
        settings["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "tokenizer_class", ["GPT2Tokenizer", "PreTrainedTokenizerFast", "Qwen2Tokenizer", "TokenizersBackend"]
)
def test_the_same_tokenizer_as_autotokenizer_alone(
    tmp_path: Path, model_type: str, tokenizer_class: str
) -> None:
    folder = tokenizer_folder(tmp_path, model_type, tokenizer_class)
    assert "config" in _class_choice(str(folder))  # the shortcut is taken here
    ours, theirs = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(theirs)
    assert ours(TEXT).input_ids == theirs(TEXT).input_ids
    assert ours.decode(ours(TEXT).input_ids) == theirs.decode(theirs(TEXT).input_ids)
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.model_max_length == theirs.model_max_length
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_without_a_named_class_autotokenizer_reads_the_config_itself(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, "llama", None)
    assert _class_choice(str(folder)) == {}
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "X", "auto_map": {}}))
    assert _class_choice(str(folder)) == {}  # remote code: left to AutoTokenizer
    assert _class_choice(str(tmp_path / "absent")) == {}
