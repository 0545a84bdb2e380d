"""The torch backend's decode-only path (paged_decode.py) against its general path, bit for bit.

fitserve's C decode attention, which takes float32 decode steps on CPUs it builds on, is off here
(FITSERVE_CPU_KERNELS=0); tests/unit/test_cpu_decode_attention.py checks it against the same paths."""

from __future__ import annotations

import pytest
import torch

from fitserve.layers.attention import cpu_backend
from fitserve.layers.attention.cpu_backend import CpuAttentionBackend
from fitserve.layers.attention.paged_decode import _start_of_consecutive_run, plan_decode_gather
from tests.unit.model_helpers import ChunkSpec, build_attention_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 40


@pytest.fixture(autouse=True)
def torch_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FITSERVE_CPU_KERNELS", "0")


def decode_step(
    tables: list[list[int]], seq_lens: list[int], dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple:
    """A decode step (one new token per sequence) over a cache of finite garbage, two layers deep."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    chunks = [ChunkSpec(n - 1, 1, table) for table, n in zip(tables, seq_lens, strict=True)]
    metadata = build_attention_metadata(chunks, BLOCK_SIZE)
    batch = len(tables)
    inputs = [
        (
            torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
        )
        for _ in caches
    ]
    return caches, metadata, inputs


def run_layers(caches, metadata, inputs) -> list[torch.Tensor]:
    backend = CpuAttentionBackend()
    return [backend.forward(q, k, v, cache, metadata, 0.3) for cache, (q, k, v) in zip(caches, inputs)]


def general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_backend._StepPlan, "is_decode_only", property(lambda self: False))


CASES = {
    "batch of scattered blocks": ([[7, 3, 12], [5], [30, 31, 2, 9], [1, 22]], [10, 3, 16, 5]),
    "one sequence on consecutive blocks": ([[11, 12, 13, 14]], [15]),
    "one sequence on scattered blocks": ([[11, 13, 12]], [9]),
    "one sequence, one token": ([[4]], [1]),
}


def run_fast_then_general(caches, metadata, inputs, monkeypatch) -> tuple[list, list]:
    """Runs the step on copies of `caches` as the backend chooses, then on the originals with the decode
    path turned off; asserts equal outputs and returns (fast caches, general caches)."""
    fast_caches = [cache.clone() for cache in caches]
    fast = run_layers(fast_caches, metadata, inputs)
    general_path(monkeypatch)
    general = run_layers(caches, metadata, inputs)
    for got, want in zip(fast, general, strict=True):
        assert torch.equal(got, want)
    return fast_caches, caches


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_path_equals_general_path(case: str, dtype: torch.dtype, monkeypatch) -> None:
    tables, seq_lens = CASES[case]
    caches, metadata, inputs = decode_step(tables, seq_lens, dtype)
    fast_caches, general_caches = run_fast_then_general(caches, metadata, inputs, monkeypatch)
    for got, want in zip(fast_caches, general_caches, strict=True):
        assert torch.equal(got, want)  # the same slots written, nothing else touched


def test_layers_of_one_step_read_their_own_caches() -> None:
    """The step's gather plan is shared by the layers; each layer's keys come from its own cache."""
    caches, metadata, inputs = decode_step([[11, 12, 13]], [11])
    q, k, v = inputs[0]
    backend = CpuAttentionBackend()
    first = backend.forward(q, k, v, caches[0], metadata, 0.3)
    second = backend.forward(q, k, v, caches[1], metadata, 0.3)
    assert not torch.equal(first, second)
    assert torch.equal(first, CpuAttentionBackend().forward(q, k, v, caches[0], metadata, 0.3))


def test_float8_cache_keeps_the_general_path(monkeypatch) -> None:
    caches, metadata, inputs = decode_step([[11, 12, 13]], [11])
    fp8 = [cache.to(torch.float8_e4m3fn) for cache in caches]
    run_fast_then_general(fp8, metadata, inputs, monkeypatch)


def test_consecutive_run_detection() -> None:
    assert _start_of_consecutive_run(torch.tensor([5, 6, 7])) == 5
    assert _start_of_consecutive_run(torch.tensor([9])) == 9
    assert _start_of_consecutive_run(torch.tensor([5, 7, 8])) is None
    assert _start_of_consecutive_run(torch.tensor([6, 5])) is None


def test_one_sequence_on_consecutive_blocks_is_read_in_place() -> None:
    caches, metadata, _ = decode_step([[11, 12, 13]], [11])
    block_ids = metadata.block_tables[0].to(torch.int64)
    mask = torch.zeros(1, 1, 1, 3 * BLOCK_SIZE)
    gather = plan_decode_gather(
        caches[0], metadata.slot_mapping, 1, 3 * BLOCK_SIZE, block_ids, mask, torch.empty
    )
    assert gather.first_block == 11 and gather.rows is None
    keys, values = gather.keys_and_values(caches[1])
    want = caches[1][:, 11:14].reshape(2, 3 * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    assert torch.equal(keys[0], want[0]) and torch.equal(values[0], want[1])
    assert keys.data_ptr() == caches[1][0, 11].data_ptr()  # a view: nothing copied

    scattered = plan_decode_gather(
        caches[0], metadata.slot_mapping, 1, 3 * BLOCK_SIZE, torch.tensor([11, 13, 12]), mask, torch.empty
    )
    assert scattered.first_block is None and scattered.rows is not None
