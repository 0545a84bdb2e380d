"""Offline workloads for `fitserve bench throughput`: the GPU issue's nano and equal, or fixed lengths.

nano: 256 sequences; one random.Random(0) draws the 256 input lengths, then the 256 output lengths (each
      uniform in [100, 1024]), then the prompts' token ids in order (uniform in [0, 10000]); temperature
      0.6, eos ignored, max_model_len 4096.
equal: 256 sequences of 512 prompt tokens (random.Random(0), ids uniform in [0, 10000]), 512 output
      tokens each, greedy, eos ignored.
Token ids up to 10000 fit every vocabulary of the benchmark shapes (and SmolLM2's 49,152).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOAD_NAMES = ("nano", "equal")
MAX_TOKEN_ID = 10000
NANO_NUM_SEQS = 256
NANO_MIN_LEN = 100
NANO_MAX_LEN = 1024
NANO_TEMPERATURE = 0.6
NANO_MAX_MODEL_LEN = 4096
EQUAL_NUM_SEQS = 256
EQUAL_INPUT_LEN = 512
EQUAL_OUTPUT_LEN = 512
# vLLM's offline throughput benchmark samples at temperature 1.
FIXED_LENGTH_TEMPERATURE = 1.0


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[OfflineRequest]
    temperature: float
    max_model_len: int | None  # the context length the workload is defined with; None = the model's
    max_token_id: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def nano_workload() -> Workload:
    rng = random.Random(0)
    input_lens = [rng.randint(NANO_MIN_LEN, NANO_MAX_LEN) for _ in range(NANO_NUM_SEQS)]
    output_lens = [rng.randint(NANO_MIN_LEN, NANO_MAX_LEN) for _ in range(NANO_NUM_SEQS)]
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(length)] for length in input_lens]
    requests = [OfflineRequest(ids, out) for ids, out in zip(prompts, output_lens, strict=True)]
    return Workload("nano", requests, NANO_TEMPERATURE, NANO_MAX_MODEL_LEN, MAX_TOKEN_ID)


def equal_workload() -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(EQUAL_INPUT_LEN)] for _ in range(EQUAL_NUM_SEQS)]
    requests = [OfflineRequest(ids, EQUAL_OUTPUT_LEN) for ids in prompts]
    return Workload("equal", requests, 0.0, None, MAX_TOKEN_ID)


def fixed_length_workload(
    num_prompts: int, input_len: int, output_len: int, seed: int, vocab_size: int
) -> Workload:
    """num_prompts x (input_len random ids, output_len tokens), ids below min(10001, vocab_size)."""
    max_token_id = min(MAX_TOKEN_ID, vocab_size - 1)
    rng = random.Random(seed)
    requests = [
        OfflineRequest([rng.randint(0, max_token_id) for _ in range(input_len)], output_len)
        for _ in range(num_prompts)
    ]
    return Workload(
        f"{num_prompts}x({input_len} in, {output_len} out)",
        requests,
        FIXED_LENGTH_TEMPERATURE,
        None,
        max_token_id,
    )


def named_workload(name: str) -> Workload:
    if name == "nano":
        return nano_workload()
    if name == "equal":
        return equal_workload()
    raise ValueError(f"workload={name!r} is not one of {', '.join(WORKLOAD_NAMES)}: pick one of them")
