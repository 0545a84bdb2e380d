"""bench serve datasets: random lengths within the range-ratio bounds, shared prefix, seeds; files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fitserve.bench.datasets import (
    LengthBounds,
    random_length_bounds,
    sample_custom_requests,
    sample_random_requests,
    sample_requests,
    sample_sharegpt_requests,
)
from tests.paths import SMOLLM2_TOKENIZER_DIR

TOKENIZER_PATH = str(SMOLLM2_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_PATH)


def encoded(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_bounds_follow_vllm_floor_and_ceil():
    assert random_length_bounds(100, 50, 0.5) == LengthBounds(50, 150, 25, 75)
    assert random_length_bounds(100, 50, 0.25, num_special_tokens=2) == LengthBounds(73, 123, 37, 63)
    # the output lower bound never drops below one token
    assert random_length_bounds(10, 1, 0.9).output_low == 1
    with pytest.raises(ValueError, match=r"random_range_ratio=1.0 is outside \[0, 1\)"):
        random_length_bounds(10, 10, 1.0)


def test_random_lengths_stay_within_the_ratio_bounds(tokenizer):
    requests = sample_random_requests(tokenizer, 40, input_len=64, output_len=16, range_ratio=0.5, seed=3)
    assert len(requests) == 40
    assert all(32 <= r.prompt_len <= 96 for r in requests)
    assert all(8 <= r.expected_output_len <= 24 for r in requests)
    # the lengths really vary, and each prompt's recorded count is its true token count
    assert len({r.prompt_len for r in requests}) > 5
    assert len({r.expected_output_len for r in requests}) > 5
    assert all(len(encoded(tokenizer, r.prompt)) == r.prompt_len for r in requests)


def test_ratio_zero_gives_exact_lengths(tokenizer):
    requests = sample_random_requests(tokenizer, 10, input_len=16, output_len=8, seed=0)
    assert [r.prompt_len for r in requests] == [16] * 10
    assert [r.expected_output_len for r in requests] == [8] * 10


def test_prefix_is_shared_and_adds_to_the_length(tokenizer):
    prefix_len = 24
    requests = sample_random_requests(tokenizer, 6, input_len=16, output_len=4, prefix_len=prefix_len, seed=1)
    assert all(r.prompt_len == prefix_len + 16 for r in requests)
    ids = [encoded(tokenizer, r.prompt) for r in requests]
    shared = 0
    while all(len(i) > shared and i[shared] == ids[0][shared] for i in ids):
        shared += 1
    # the prefix's last token may merge with the body's first after decode and re-encode
    assert prefix_len - 1 <= shared < prefix_len + 16
    unprefixed = sample_random_requests(tokenizer, 6, input_len=16, output_len=4, seed=1)
    assert len({encoded(tokenizer, r.prompt)[0] for r in unprefixed}) > 1


def test_same_seed_same_prompts_other_seed_other_prompts(tokenizer):
    first = sample_random_requests(tokenizer, 8, input_len=32, output_len=8, range_ratio=0.3, seed=7)
    again = sample_random_requests(tokenizer, 8, input_len=32, output_len=8, range_ratio=0.3, seed=7)
    other = sample_random_requests(tokenizer, 8, input_len=32, output_len=8, range_ratio=0.3, seed=8)
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]


def test_too_short_random_prompts_are_refused(tokenizer):
    with pytest.raises(ValueError, match="random prompts could be empty"):
        sample_random_requests(tokenizer, 2, input_len=1, output_len=4, range_ratio=0.5)


def write_sharegpt(path: Path, tokenizer) -> None:
    long_reply = " ".join(["word"] * 3000)
    entries = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me about the moon and its phases please."},
                {"from": "gpt", "value": "The moon has phases because of its orbit around us."},
            ]
        },
        {
            "conversations": [
                {"from": "human", "value": "What is the capital city of France today?"},
                {"from": "gpt", "value": "Paris is the capital city of France, since long ago."},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend"}]},
        {
            "conversations": [
                {"from": "human", "value": "Write a long essay on rivers."},
                {"from": "gpt", "value": long_reply},
            ]
        },
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "no conversations"},
    ]
    path.write_text(json.dumps(entries), encoding="utf-8")


def test_sharegpt_prunes_and_oversamples(tmp_path, tokenizer):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, tokenizer)
    requests = sample_sharegpt_requests(tokenizer, str(path), 5, seed=0)
    assert len(requests) == 5
    # only the moon and Paris pairs survive: "hi" is too short, the essay too long, one-turn entries skipped
    assert {r.prompt for r in requests} == {
        "Tell me about the moon and its phases please.",
        "What is the capital city of France today?",
    }
    for r in requests:
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)
        assert r.expected_output_len > 4
    fixed = sample_sharegpt_requests(tokenizer, str(path), 2, output_len=7, seed=0)
    assert [r.expected_output_len for r in fixed] == [7, 7]


def test_custom_jsonl_with_and_without_chat_template(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "What is two plus two?"}\n\n{"prompt": "Name a red fruit."}\n', encoding="utf-8"
    )
    templated = sample_custom_requests(tokenizer, str(path), 2, output_len=32, seed=0)
    assert all("<|im_start|>user" in r.prompt for r in templated)
    assert all(r.expected_output_len == 32 for r in templated)
    raw = sample_custom_requests(tokenizer, str(path), 3, output_len=5, apply_chat_template=False, seed=0)
    assert len(raw) == 3
    assert {r.prompt for r in raw} == {"What is two plus two?", "Name a red fruit."}


def test_dataset_file_errors_say_what_to_fix(tmp_path, tokenizer):
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(ValueError, match=f"cannot read --dataset-path {missing}"):
        sample_custom_requests(tokenizer, str(missing), 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match='line 2 of --dataset-path .* has no "prompt" string'):
        sample_custom_requests(tokenizer, str(bad), 1)
    not_list = tmp_path / "dict.json"
    not_list.write_text('{"conversations": []}', encoding="utf-8")
    with pytest.raises(ValueError, match="is not a ShareGPT file"):
        sample_sharegpt_requests(tokenizer, str(not_list), 1)
    with pytest.raises(ValueError, match="--dataset-name custom reads a file: add --dataset-path FILE"):
        sample_requests("custom", tokenizer, 1)
    with pytest.raises(ValueError, match="dataset_name='other' is not one of random, sharegpt, custom"):
        sample_requests("other", tokenizer, 1, dataset_path=str(path_of(tmp_path)))


def path_of(tmp_path: Path) -> Path:
    target = tmp_path / "any.jsonl"
    target.write_text('{"prompt": "x"}\n', encoding="utf-8")
    return target
