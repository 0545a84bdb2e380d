"""The kernels the Llama-3.1-8B shape runs at batch 1 and batch 32, under the H100's choices and under the
forced sm_75 ones (issue 35: benchmarks/gpu/sm75_path.py's greedy tokens agree at batch 1 and part ways at
batch 32). Under Triton's interpreter on the CPU, with the H100's 132 SMs:
- at batch 32 (one partition, 256 programs) decode attention takes WHOLE_CONTEXT_CONFIG's 128-key tiles on
  the H100 and DEFAULT_DECODE_CONFIG's 64-key tiles on sm_75 (64 KB of shared memory); both are within one
  fp16 rounding of kernels/reference.py, and of each other: the online softmax rounds p to fp16 against
  a running max taken over other tiles, so the two differ in the last bit of some outputs;
- at batch 1 (split-K over 64 partitions, the default tile either way) decode attention, and the skinny
  and swapped GEMMs at any stage count, give the same bits under both targets: the targets change no
  arithmetic there.
So the batch-1 run computes the same numbers on both paths, and the batch-32 run does not (decode attention).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child process: this file
run as a script with the variable set (tests/unit/triton_interpreter.py).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.unit.triton_interpreter import run_in_interpreter

H100_SMS = 132
BLOCK_SIZE, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 32, 8, 128
CONTEXT = 129  # the first decode token after a 128-token prompt
TABLE_BLOCKS = 256  # a CUDA graph's block table: max_model_len 4096
TARGETS = {"h100": None, "sm75": [7, 5]}


def fp16_spacing(magnitude: float) -> float:
    """The gap between neighbouring fp16 values at `magnitude` (normal range): one rounding step there."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - 10)


@pytest.fixture(scope="module")
def results() -> dict:
    return run_in_interpreter(__file__, list(TARGETS))


def test_batch_32_decode_attention_takes_another_tile_on_sm75(results: dict) -> None:
    assert results["h100"]["decode32"]["partitions"] == results["sm75"]["decode32"]["partitions"] == 1
    assert results["h100"]["decode32"]["tile_tokens"] == 128  # WHOLE_CONTEXT_CONFIG
    assert results["sm75"]["decode32"]["tile_tokens"] == 64  # DEFAULT_DECODE_CONFIG


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("batch", ["decode32", "decode1"])
def test_decode_attention_matches_the_reference(results: dict, target: str, batch: str) -> None:
    got = results[target][batch]
    assert got["max_ref"] > 1.0, got  # a real output, not zeros against zeros
    assert got["error"] <= fp16_spacing(got["max_ref"]), got


def test_batch_32_decode_attention_differs_between_targets_by_rounding_only(results: dict) -> None:
    h100, sm75 = (
        torch.tensor(results[name]["decode32"]["bits"], dtype=torch.int16).view(torch.float16).float()
        for name in TARGETS
    )
    assert (h100 - sm75).abs().max().item() <= fp16_spacing(h100.abs().max().item())


def test_batch_1_kernels_give_the_same_bits_on_both_targets(results: dict) -> None:
    h100, sm75 = results["h100"], results["sm75"]
    assert h100["decode1"]["partitions"] == sm75["decode1"]["partitions"] == 64
    assert h100["decode1"]["tile_tokens"] == sm75["decode1"]["tile_tokens"] == 64
    assert h100["decode1"]["bits"] == sm75["decode1"]["bits"]
    # the GEMMs' stage counts differ (fewer on sm_75's 64 KB), their sums do not
    assert h100["skinny_stages"] != sm75["skinny_stages"] and h100["swapped_stages"] != sm75["swapped_stages"]
    for gemm in ("skinny", "swapped"):
        assert h100[gemm]["bits"] == sm75[gemm]["bits"], gemm
        assert h100[gemm]["error"] <= 2.0**-8 and h100[gemm]["max_ref"] > 0.5, (gemm, h100[gemm])


# --- the child process: runs the kernels under the interpreter -------------------------------------------


def _paged(num_seqs: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp16 cache of num_seqs contexts of CONTEXT tokens in shuffled blocks (block 0 unused), and
    block tables TABLE_BLOCKS wide."""
    blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
    cache = torch.zeros(2, num_seqs * blocks_per_seq + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float16)
    tables = torch.zeros(num_seqs, TABLE_BLOCKS, dtype=torch.int32)
    tables[:, :blocks_per_seq] = (torch.randperm(num_seqs * blocks_per_seq, generator=generator) + 1).view(
        num_seqs, blocks_per_seq
    )
    positions = torch.arange(CONTEXT)
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    for seq in range(num_seqs):
        slots = tables[seq, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        flat[:, slots] = (1.3 * torch.randn(2, CONTEXT, KV_HEADS, HEAD_DIM, generator=generator)).half()
    return cache, tables


def _decode(num_seqs: int) -> dict:
    from fitserve.kernels import capability, decode_attention, reference

    generator = torch.Generator().manual_seed(num_seqs)
    cache, tables = _paged(num_seqs, generator)
    q = (1.3 * torch.randn(num_seqs, Q_HEADS, HEAD_DIM, generator=generator)).half()
    lens = torch.full((num_seqs,), CONTEXT, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    partitions = decode_attention.choose_num_partitions(
        num_seqs, KV_HEADS, TABLE_BLOCKS * BLOCK_SIZE, H100_SMS, decode_attention.split_tile_tokens(HEAD_DIM)
    )
    shared = capability.shared_memory_per_block(capability.kernel_capability(q.device))
    config = decode_attention.choose_config(num_seqs, KV_HEADS, partitions, H100_SMS, HEAD_DIM, shared)
    out = decode_attention.paged_decode_attention(q, cache, tables, lens, scale)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    ref = reference.paged_attention_reference(q.float(), cache, starts, lens, tables, scale)
    return {
        "partitions": partitions,
        "tile_tokens": config.tile_tokens,
        "error": (out.float() - ref).abs().max().item(),
        "max_ref": ref.abs().max().item(),
        "bits": out.view(torch.int16).flatten().tolist(),
    }


def _gemm(gemm, rows: int) -> dict:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=generator).half()
    weight = (0.05 * torch.randn(256, 1024, generator=generator)).half()
    y = gemm(x, weight)
    ref = x.float() @ weight.float().T
    return {
        "error": (y.float() - ref).abs().max().item(),
        "max_ref": ref.abs().max().item(),
        "bits": y.view(torch.int16).flatten().tolist(),
    }


def _run(target: list[int] | None) -> dict:
    from fitserve.kernels import capability, skinny_gemm, swapped_gemm

    shared = capability.shared_memory_per_block(capability.kernel_capability(torch.device("cpu")))
    return {
        "decode32": _decode(32),
        "decode1": _decode(1),
        "skinny": _gemm(skinny_gemm.skinny_gemm, 1),
        "swapped": _gemm(swapped_gemm.swapped_gemm, 32),
        "skinny_stages": skinny_gemm.default_config(shared).num_stages,
        "swapped_stages": swapped_gemm.num_stages(shared),
    }


if __name__ == "__main__":
    import contextlib

    import triton  # noqa: F401  (after TRITON_INTERPRET, before the kernels)

    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    # The GEMMs launch through fast_launch and accept CUDA tensors only: in the interpreter, the plain
    # kernel on the CPU tensors. No target forced stands for the H100: its shared memory (the choosers'
    # None), without PDL (the interpreter has no griddepcontrol; PDL changes no arithmetic).
    from fitserve.kernels import fast_launch

    fast_launch.fast_launch = lambda function: function
    from fitserve.kernels import capability, decode_attention, skinny_gemm, swapped_gemm

    decode_attention._sm_count = lambda index: H100_SMS
    skinny_gemm.supports = lambda x, weight: True
    swapped_gemm.supports = lambda x, weight: True
    answers = {}
    for name in json.loads(sys.argv[1]):
        target = TARGETS[name]
        with capability.forced_target(tuple(target)) if target else contextlib.nullcontext():
            answers[name] = _run(target)
    print(json.dumps(answers))
