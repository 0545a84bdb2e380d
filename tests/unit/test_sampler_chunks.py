"""The sampler's float32 chunks (worker/sampler.py): a batch larger than SAMPLER_ROWS_PER_CHUNK gives
the tokens and logprobs of sampling its rows one chunk-sized batch at a time, and of one float32 copy
of every row (the sampler before chunks); the tensors it keeps alive at once stop growing past one
chunk; and the planner's sampling term counts the logits plus one chunk."""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitserve.core.sampling_params import SamplingParams
from fitserve.planner.hardware import DeviceSpec, GiB
from fitserve.planner.memory_estimates import (
    SAMPLER_CHUNK_BYTES_PER_LOGIT,
    SAMPLER_ROWS_PER_CHUNK,
    activation_peak_bytes,
    forward_activation_bytes,
    sampling_activation_bytes,
)
from fitserve.planner.memory_inputs import with_settings
from fitserve.worker import sampler as sampler_module
from fitserve.worker import sampling_filters
from fitserve.worker.sampler import Sampler, SamplerOutput, SamplingRow, compute_prompt_logprobs
from tests.unit.planner_helpers import memory_inputs

VOCAB = 300
NUM_ROWS = 150  # more than four chunks, the last one short


def mixed_rows(seed: int, num_rows: int = NUM_ROWS) -> list[SamplingRow]:
    """Rows of every kind the sampler routes differently: greedy and random, each filter, penalties,
    logit_bias, allowed_token_ids, min_tokens, logprobs, and rows with their own generator."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        settings: dict = {"temperature": 0.0 if rng.random() < 0.3 else rng.choice([0.5, 1.0, 1.3])}
        if rng.random() < 0.4:
            settings["top_k"] = rng.choice([1, 5, 50, VOCAB - 1])
        if rng.random() < 0.4:
            settings["top_p"] = rng.choice([0.5, 0.9, 0.99])
        if rng.random() < 0.3:
            settings["min_p"] = rng.choice([0.01, 0.1])
        if rng.random() < 0.2:
            settings["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            settings["presence_penalty"] = 0.5
        if rng.random() < 0.1:
            settings["logit_bias"] = {3: 5.0, 7: -2.0}
        if rng.random() < 0.1:
            settings["allowed_token_ids"] = list(range(0, VOCAB, 3))
        if rng.random() < 0.1:
            settings["min_tokens"], settings["stop_token_ids"] = 3, [1]
        if rng.random() < 0.3:
            settings["logprobs"] = rng.choice([0, 2, 5])
        if rng.random() < 0.2:
            settings["seed"] = rng.randrange(1000)
        params = SamplingParams(**settings)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(4))]
        rows.append(
            SamplingRow(params, [rng.randrange(VOCAB) for _ in range(5)], output, generator, frozenset({2}))
        )
    return rows


def batch_logits(seed: int, num_rows: int = NUM_ROWS) -> torch.Tensor:
    return torch.randn((num_rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * 3


def as_lists(out: SamplerOutput) -> tuple[list[int], list]:
    logprobs = [None if e is None else (e.token_ids, e.logprobs, e.ranks) for e in out.logprobs]
    return out.sampled_token_ids, logprobs


def sample_whole(logits: torch.Tensor, rows_seed: int, torch_seed: int) -> tuple[list[int], list]:
    torch.manual_seed(torch_seed)
    return as_lists(Sampler()(logits, mixed_rows(rows_seed)))


@pytest.mark.parametrize("case", range(4))
def test_a_large_batch_samples_as_its_chunks_one_at_a_time(case: int) -> None:
    logits = batch_logits(case)
    whole = sample_whole(logits, rows_seed=case, torch_seed=100 + case)
    torch.manual_seed(100 + case)
    rows = mixed_rows(case)
    tokens: list[int] = []
    logprobs: list = []
    for first in range(0, NUM_ROWS, SAMPLER_ROWS_PER_CHUNK):
        last = first + SAMPLER_ROWS_PER_CHUNK
        part_tokens, part_logprobs = as_lists(Sampler()(logits[first:last], rows[first:last]))
        tokens += part_tokens
        logprobs += part_logprobs
    assert whole == (tokens, logprobs)
    assert len(set(tokens)) > 20  # random rows drew many different tokens: the draws mattered


@pytest.mark.parametrize("rows_per_chunk", [1000, 7])
def test_chunks_sample_as_one_float32_copy_of_every_row(
    monkeypatch: pytest.MonkeyPatch, rows_per_chunk: int
) -> None:
    """1000 rows a chunk is the sampler before chunks (one float32 copy of the batch); 7 puts chunk
    edges everywhere."""
    logits = batch_logits(7)
    chunked = sample_whole(logits, rows_seed=7, torch_seed=5)
    monkeypatch.setattr(sampler_module, "SAMPLER_ROWS_PER_CHUNK", rows_per_chunk)
    assert sample_whole(logits, rows_seed=7, torch_seed=5) == chunked
    prompt_logits = batch_logits(8)
    next_ids = [i % VOCAB for i in range(NUM_ROWS)]
    with_chunks = compute_prompt_logprobs(prompt_logits, next_ids, num_top=3)
    monkeypatch.setattr(sampler_module, "SAMPLER_ROWS_PER_CHUNK", SAMPLER_ROWS_PER_CHUNK)
    assert compute_prompt_logprobs(prompt_logits, next_ids, num_top=3) == with_chunks


@pytest.mark.parametrize("values_per_pass", [10**9, 1])
def test_a_top_k_past_4096_samples_as_in_one_pass(
    monkeypatch: pytest.MonkeyPatch, values_per_pass: int
) -> None:
    """Large top_k rows go through topk a few rows at a time (sampling_filters.TOP_K_VALUES_PER_PASS):
    the same tokens as all rows of a chunk in one pass (10**9) or one row a pass (1)."""
    vocab, ks = 10_000, [9000, 5000, 0, 4097, 20, 9999]
    logits = torch.randn((70, vocab), generator=torch.Generator().manual_seed(3)) * 0.5

    def sample() -> list[int]:
        params = [
            SamplingParams(top_k=ks[i % len(ks)], top_p=0.999 if i % 4 == 0 else 1.0) for i in range(70)
        ]
        torch.manual_seed(3)
        return Sampler()(
            logits, [SamplingRow(p, [0], [], None, frozenset()) for p in params]
        ).sampled_token_ids

    passes_of_a_few_rows = sample()
    monkeypatch.setattr(sampling_filters, "TOP_K_VALUES_PER_PASS", values_per_pass)
    assert sample() == passes_of_a_few_rows
    # each row's token is among its top_k logits
    for i, token in enumerate(passes_of_a_few_rows):
        k = ks[i % len(ks)]
        if k:
            assert logits[i, token] >= logits[i].topk(k).values[-1]


class LiveTensorBytes(TorchDispatchMode):
    """The most bytes of storage that torch operations made while this mode was on and that were
    referenced at the same time (storages that existed before, such as the caller's logits, are not
    counted, nor are their views)."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, list[int]] = {}  # data_ptr -> [bytes, Python tensors referencing it]
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer == 0 or pointer in self.existing:
            return
        entry = self.live.get(pointer)
        if entry is None:
            entry = self.live[pointer] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, pointer)

    def _release(self, pointer: int) -> None:
        entry = self.live[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[pointer]


def sampler_peak_bytes(num_rows: int, params: SamplingParams, vocab: int = 4096) -> int:
    logits = torch.randn((num_rows, vocab), generator=torch.Generator().manual_seed(num_rows))
    rows = [SamplingRow(params, [0, 1], [2], None, frozenset()) for _ in range(num_rows)]
    with LiveTensorBytes([logits]) as live:
        Sampler()(logits, rows)
    return live.peak


FILTERED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, presence_penalty=0.5, logprobs=2)


def test_the_float32_working_set_stops_growing_at_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 4096
    one_chunk = sampler_peak_bytes(SAMPLER_ROWS_PER_CHUNK, FILTERED, vocab)
    many_chunks = sampler_peak_bytes(8 * SAMPLER_ROWS_PER_CHUNK, FILTERED, vocab)
    # a float32 copy of one chunk is counted: the measurement sees the working set
    assert one_chunk > SAMPLER_ROWS_PER_CHUNK * vocab * 4
    # eight times the rows: only per-row tensors (ids, parameters) grow, not [rows, vocab] ones
    assert many_chunks < one_chunk + SAMPLER_ROWS_PER_CHUNK * vocab
    # on the CPU no sort scratch is torch's to count: the planner's bytes per logit bound the rest
    assert many_chunks <= SAMPLER_ROWS_PER_CHUNK * vocab * SAMPLER_CHUNK_BYTES_PER_LOGIT
    # and one float32 copy of every row (the sampler before chunks) grows with the rows
    monkeypatch.setattr(sampler_module, "SAMPLER_ROWS_PER_CHUNK", 10_000)
    assert sampler_peak_bytes(8 * SAMPLER_ROWS_PER_CHUNK, FILTERED, vocab) > 4 * one_chunk


def test_greedy_rows_make_nothing_of_rows_by_vocab() -> None:
    vocab, num_rows = 4096, 4 * SAMPLER_ROWS_PER_CHUNK
    assert sampler_peak_bytes(num_rows, SamplingParams(temperature=0.0), vocab) < num_rows * 64


LLAMA_8B_VOCAB, LLAMA_8B_HIDDEN = 128_256, 4096


def test_sampling_term_counts_the_logits_and_one_chunk() -> None:
    """Llama-3.1-8B shape, max_num_seqs 256, max_num_batched_tokens 1024, on an H100."""
    inputs = memory_inputs("llama-3.1-8b", max_num_batched_tokens=1024, max_num_seqs=256)
    hidden_states = 1024 * LLAMA_8B_HIDDEN * 2
    logits = 256 * LLAMA_8B_VOCAB * 2
    chunk = 32 * LLAMA_8B_VOCAB * 52
    assert (SAMPLER_ROWS_PER_CHUNK, SAMPLER_CHUNK_BYTES_PER_LOGIT) == (32, 52)
    planned = sampling_activation_bytes(inputs, 1024, 256)
    assert planned == hidden_states + logits + chunk
    # before chunks: the logits plus four float32 copies of every row (SAMPLER_FP32_COPIES = 4)
    before = hidden_states + 256 * LLAMA_8B_VOCAB * (2 + 4 * 4)
    assert before - planned == 256 * LLAMA_8B_VOCAB * 16 - chunk == 311_918_592  # 0.29 GiB
    # the sampling peak is the step's: the forward at 1,024 tokens is smaller
    assert forward_activation_bytes(inputs, 1024) < planned == activation_peak_bytes(inputs)


def test_sampling_term_past_one_chunk_grows_by_the_logits_alone() -> None:
    inputs = memory_inputs("llama-3.1-8b", max_num_batched_tokens=1024)
    at = {rows: sampling_activation_bytes(inputs, 1024, rows) for rows in (16, 32, 64, 512, 1024)}
    per_row_in_chunk = LLAMA_8B_VOCAB * (2 + SAMPLER_CHUNK_BYTES_PER_LOGIT)
    assert at[32] - at[16] == 16 * per_row_in_chunk
    assert at[512] - at[64] == 448 * LLAMA_8B_VOCAB * 2
    # from 832 rows on, a mixed batch's gathered random rows (2 bytes a logit) outweigh one chunk
    assert at[1024] - at[512] == 512 * LLAMA_8B_VOCAB * 2 * 2 - (32 * 52 - 512 * 2) * LLAMA_8B_VOCAB


def test_cpu_logits_are_float32() -> None:
    """On the CPU the LM head widens the logits to float32 (layers/vocab_embedding.py)."""
    gpu = memory_inputs("llama-3.1-8b", max_num_batched_tokens=1024)
    cpu = with_settings(gpu, device=DeviceSpec("cpu", 0, "CPU (16 cores, 64.0 GiB RAM)", 64 * GiB, 60 * GiB))
    difference = sampling_activation_bytes(cpu, 1024, 256) - sampling_activation_bytes(gpu, 1024, 256)
    assert difference == 256 * LLAMA_8B_VOCAB * 2
