"""Prompts for `fitserve bench serve`: random token text, ShareGPT JSON or a custom JSONL file.

The random dataset follows `vllm bench serve`'s semantics, draw for draw: one numpy generator seeded
with --seed draws the input lengths, then the output lengths, then a token offset per request, then the
shared prefix. Lengths are uniform integers in [floor(L * (1 - r)), ceil(L * (1 + r))] for a mean L and
--random-range-ratio r (output lengths at least 1); the input mean first loses the special tokens the
tokenizer adds itself. A prompt is --random-prefix-len shared tokens followed by consecutive allowed
token ids (special ids left out), decoded to text and re-encoded until it has the drawn token count.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASET_NAMES = ("random", "sharegpt", "custom")
DEFAULT_RANDOM_INPUT_LEN = 1024
DEFAULT_RANDOM_OUTPUT_LEN = 128
DEFAULT_CUSTOM_OUTPUT_LEN = 256
# Re-encode attempts before a random prompt keeps the token count it has.
MAX_LENGTH_FIT_TRIES = 10
# ShareGPT pruning, as vLLM does it: pairs with a short side or too long a total are skipped.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, counted with the benchmark's tokenizer
    expected_output_len: int  # sent as max_tokens


@dataclass(frozen=True)
class LengthBounds:
    input_low: int
    input_high: int
    output_low: int
    output_high: int


def random_length_bounds(
    input_len: int, output_len: int, range_ratio: float, num_special_tokens: int = 0
) -> LengthBounds:
    """The inclusive ranges random input and output lengths are drawn from (prefix not included)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(
            f"random_range_ratio={range_ratio} is outside [0, 1): set --random-range-ratio to a fraction "
            "such as 0.5 (0 = every request exactly --random-input-len / --random-output-len)"
        )
    real_input_len = max(0, input_len - num_special_tokens)
    return LengthBounds(
        input_low=math.floor(real_input_len * (1 - range_ratio)),
        input_high=math.ceil(real_input_len * (1 + range_ratio)),
        output_low=max(1, math.floor(output_len * (1 - range_ratio))),
        output_high=max(1, math.ceil(output_len * (1 + range_ratio))),
    )


def sample_random_requests(
    tokenizer: Any,
    num_requests: int,
    input_len: int = DEFAULT_RANDOM_INPUT_LEN,
    output_len: int = DEFAULT_RANDOM_OUTPUT_LEN,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    num_special = int(tokenizer.num_special_tokens_to_add())
    bounds = random_length_bounds(input_len, output_len, range_ratio, num_special)
    if prefix_len + bounds.input_low < 1:
        raise ValueError(
            f"random prompts could be empty: --random-input-len {input_len} with --random-range-ratio "
            f"{range_ratio} and {num_special} special token(s) allows {bounds.input_low} tokens: raise "
            "--random-input-len or --random-prefix-len, or lower --random-range-ratio"
        )
    rng = np.random.default_rng(seed)
    vocab_size = int(tokenizer.vocab_size)
    input_lens = rng.integers(bounds.input_low, bounds.input_high + 1, size=num_requests)
    output_lens = rng.integers(bounds.output_low, bounds.output_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    special_ids = set(tokenizer.all_special_ids)
    allowed = np.array([token for token in range(vocab_size) if token not in special_ids])
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    requests = []
    for index in range(num_requests):
        body = allowed[(int(offsets[index]) + index + np.arange(int(input_lens[index]))) % len(allowed)]
        target_len = prefix_len + int(input_lens[index])
        prompt, token_ids = fit_text_to_token_count(tokenizer, prefix + body.tolist(), target_len, rng)
        requests.append(SampleRequest(prompt, len(token_ids), int(output_lens[index])))
    return requests


def fit_text_to_token_count(
    tokenizer: Any, token_ids: list[int], target_len: int, rng: np.random.Generator
) -> tuple[str, list[int]]:
    """Text whose re-encoding has `target_len` tokens where the tokenizer allows it.

    Decoding then encoding can merge or split tokens, so the ids are re-encoded, cut or topped up with
    random ids and tried again, at most MAX_LENGTH_FIT_TRIES times; the last text is kept as it is.
    """
    ids = list(token_ids)
    for attempt in range(MAX_LENGTH_FIT_TRIES + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target_len or attempt == MAX_LENGTH_FIT_TRIES:
            break
        if len(ids) > target_len:
            ids = ids[:target_len]
        else:
            ids += rng.integers(0, int(tokenizer.vocab_size), size=target_len - len(ids)).tolist()
    return text, ids


def sample_sharegpt_requests(
    tokenizer: Any, path: str, num_requests: int, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """First human turn as the prompt; the reply's token count as max_tokens unless output_len is set."""
    entries = _read_json(path)
    if not isinstance(entries, list):
        raise ValueError(
            f"--dataset-path {path} is not a ShareGPT file: expected a JSON list of "
            '{"conversations": [...]} entries, found a JSON ' + type(entries).__name__
        )
    conversations = [
        entry["conversations"]
        for entry in entries
        if isinstance(entry, dict) and isinstance(entry.get("conversations"), list)
        if len(entry["conversations"]) >= 2
    ]
    rng = random.Random(seed)
    rng.shuffle(conversations)
    requests: list[SampleRequest] = []
    for turns in conversations:
        if len(requests) == num_requests:
            break
        prompt, reply = _turn_text(turns[0]), _turn_text(turns[1])
        if prompt is None or reply is None:
            continue
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        too_short = prompt_len < SHAREGPT_MIN_LEN or (output_len is None and reply_len < SHAREGPT_MIN_LEN)
        too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN
        if not (too_short or too_long):
            requests.append(SampleRequest(prompt, prompt_len, reply_len))
    if not requests:
        raise ValueError(
            f"--dataset-path {path} holds no usable conversation (two turns, prompt of "
            f"{SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} tokens, at most {SHAREGPT_MAX_TOTAL_LEN} in all)"
        )
    return _oversample(requests, num_requests, rng)


def sample_custom_requests(
    tokenizer: Any,
    path: str,
    num_requests: int,
    output_len: int = DEFAULT_CUSTOM_OUTPUT_LEN,
    apply_chat_template: bool = True,
    seed: int = 0,
) -> list[SampleRequest]:
    """A JSONL file, one {"prompt": "..."} per line; shuffled with --seed, then the first N taken."""
    prompts = _read_custom_prompts(path)
    rng = random.Random(seed)
    rng.shuffle(prompts)
    use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    requests = []
    for prompt in prompts[:num_requests]:
        if use_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        requests.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len))
    return _oversample(requests, num_requests, rng)


def _oversample(requests: list[SampleRequest], num_requests: int, rng: random.Random) -> list[SampleRequest]:
    """Fewer samples than asked: repeat random ones (seeded) until there are num_requests."""
    if len(requests) < num_requests:
        requests = requests + rng.choices(requests, k=num_requests - len(requests))
    return requests


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"cannot read --dataset-path {path}: {error.strerror or error}") from None


def _read_json(path: str) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"--dataset-path {path} is not valid JSON ({error})") from None


def _read_custom_prompts(path: str) -> list[str]:
    prompts = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"line {number} of --dataset-path {path} is not valid JSON ({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(
                f'line {number} of --dataset-path {path} has no "prompt" string: write one '
                '{"prompt": "..."} object per line'
            )
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(
            f'--dataset-path {path} holds no prompt: write one {{"prompt": "..."}} object per line'
        )
    return prompts


def _turn_text(turn: Any) -> str | None:
    value = turn.get("value") if isinstance(turn, dict) else None
    return value if isinstance(value, str) else None


def sample_requests(
    dataset_name: str,
    tokenizer: Any,
    num_requests: int,
    dataset_path: str | None = None,
    seed: int = 0,
    random_options: dict[str, Any] | None = None,
    output_len: int | None = None,
    apply_chat_template: bool = True,
) -> list[SampleRequest]:
    """The requests of one dataset; `output_len` overrides ShareGPT's and custom's output lengths."""
    if dataset_name == "random":
        return sample_random_requests(tokenizer, num_requests, seed=seed, **(random_options or {}))
    if dataset_path is None:
        raise ValueError(f"--dataset-name {dataset_name} reads a file: add --dataset-path FILE")
    if dataset_name == "sharegpt":
        return sample_sharegpt_requests(tokenizer, dataset_path, num_requests, output_len, seed)
    if dataset_name == "custom":
        custom_len = DEFAULT_CUSTOM_OUTPUT_LEN if output_len is None else output_len
        return sample_custom_requests(
            tokenizer, dataset_path, num_requests, custom_len, apply_chat_template, seed
        )
    raise ValueError(
        f"dataset_name={dataset_name!r} is not one of {', '.join(DATASET_NAMES)}: pick one of them"
    )


def describe_lengths(requests: Sequence[SampleRequest]) -> str:
    inputs = [r.prompt_len for r in requests]
    outputs = [r.expected_output_len for r in requests]
    return (
        f"{len(requests)} prompts: input {min(inputs)}..{max(inputs)} tokens, "
        f"output {min(outputs)}..{max(outputs)} tokens"
    )
