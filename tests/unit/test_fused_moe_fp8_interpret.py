"""kernels/fused_moe_fp8.py (the fp8 experts' grouped kernels) under Triton's CPU interpreter against the
dequantized experts' torch arithmetic (test_fused_moe_int4_interpret's reference: each pair's act(gate) * up
rounded, each weighted row rounded, a token's rows summed in float32).

Cases: a scale a row (per-tensor / per-channel checkpoints), 128-column block scales (Qwen's FP8 releases)
with K a multiple of the block and with a partial last block, 32-column groups (BLOCK_K cut to the group),
the decode-sized and the larger tiles, float16, gelu-tanh (Gemma-4), expert parallel. Experts no pair
chose get NaN scales: the result stays finite only if nothing reads them. W8A8 (the activations quantized
per token and 128 columns) against the same arithmetic on layers/moe_fp8.fake_quantize_groups' activations;
kernels/moe_decode.py's kernels over fp8 experts (one token's path) against the W8A16 arithmetic. Forced
targets below 8.9 run the weights as bytes (kernels/fp8_bits.py) on the W8A16 kernels."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.unit.test_fused_moe_int4_interpret import _reference
from tests.unit.triton_interpreter import (
    answer_cases,
    assert_case_matches,
    case_result,
    run_in_interpreter,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
TOLERANCE = {"bfloat16": 2**-7, "float16": 2**-9}


def case(
    tokens: int, dtype: str = "bfloat16", hidden: int = 256, inter: int = 128, group=None, **extra
) -> dict:
    return {"tokens": tokens, "dtype": dtype, "hidden": hidden, "inter": inter, "group": group, "top_k": 2,
            "act": "silu", "ep": None, "w8a8": False, "decode": False, **extra}  # fmt: skip


CASES = [
    case(1),  # a scale a row
    case(3, group=128),  # 128-column blocks
    case(2, "float16", hidden=320, inter=192, group=128),  # partial last blocks of hidden and of I
    case(4, hidden=128, inter=64, group=32, act="gelu_tanh"),  # groups narrower than the tile's BLOCK_K
    case(70, hidden=128, inter=64, group=64),  # the larger tiles (BLOCK_M 64)
    case(5, group=128, ep=[1, 2]),  # expert parallel: the second half of the experts
    # W8A8: the activations quantized per token and 128 columns (the layer's input and the intermediate)
    case(1, w8a8=True),  # a scale a row
    case(3, group=128, w8a8=True),  # 128-column blocks
    case(2, "float16", inter=192, group=128, w8a8=True),  # a partial last group of I
    case(4, hidden=128, inter=64, group=32, act="gelu_tanh", w8a8=True),  # weight groups below BLOCK_K
    case(70, hidden=128, inter=192, group=64, w8a8=True),  # the larger tiles (BLOCK_M 64)
    case(5, group=128, ep=[1, 2], w8a8=True),
    # kernels/moe_decode.py's two kernels over fp8 experts (W8A16; layers/moe_fp8.py sends one token there)
    case(1, decode=True),  # a scale a row
    case(1, group=128, decode=True),  # 128-column blocks
    case(2, "float16", hidden=320, inter=192, group=128, decode=True),  # partial last blocks
    case(1, hidden=128, inter=64, group=32, act="gelu_tanh", decode=True),  # groups below BLOCK_K
    case(3, group=128, ep=[1, 2], decode=True),
    # below compute capability 8.9 (a forced target): the weights as bytes, decoded by kernels/fp8_bits.py,
    # W8A16 on the grouped kernels (no fp8 tensor cores) and the decode kernels
    case(3, group=128, target=[8, 0]),
    case(70, hidden=128, inter=64, group=64, target=[8, 0]),
    case(1, decode=True, target=[7, 5]),
    # W8A8 as Hopper runs tiles of fewer than 64 token rows (a forced sm_90 target): the weight tile as the
    # MMA's rows (fused_moe_fp8.swaps_operands)
    case(1, w8a8=True, target=[9, 0]),  # a scale a row
    case(3, group=128, w8a8=True, target=[9, 0]),
    case(2, "float16", inter=192, group=128, w8a8=True, target=[9, 0]),  # a partial last group of I
    case(4, hidden=128, inter=64, group=32, act="gelu_tanh", w8a8=True, target=[9, 0]),
    case(5, group=128, ep=[1, 2], w8a8=True, target=[9, 0]),
    case(70, hidden=128, inter=192, group=64, w8a8=True, target=[9, 0]),  # several tiles an expert
]


def _experts(count: int, rows: int, cols: int, group: int | None, seed: int):
    """`count` random fp8 experts [rows, cols] stacked (fused_moe_fp8.Fp8Experts) and their float32 form."""
    from fitserve.kernels.fused_moe_fp8 import Fp8Experts
    from fitserve.layers.quantization.fp8_weight import dequantize, random_fp8_weight

    generator = torch.Generator().manual_seed(seed)
    weights = [random_fp8_weight(rows, cols, group, 0.05, generator) for _ in range(count)]
    stacked = Fp8Experts(
        torch.stack([w.data for w in weights]), torch.stack([w.scale for w in weights]), weights[0].group_k
    )
    return stacked, torch.stack([dequantize(w) for w in weights])


def run_case(spec: dict) -> dict:
    from fitserve.kernels.capability import forced_target

    if "target" not in spec:
        return _run_case(spec)
    with forced_target(tuple(spec["target"])):
        return _run_case(spec)


def _run_case(spec: dict) -> dict:
    from fitserve.kernels.fused_moe_fp8 import fused_moe_fp8
    from fitserve.kernels.moe_decode import moe_decode
    from fitserve.layers.moe_fp8 import fake_quantize_groups

    dtype = getattr(torch, spec["dtype"])
    experts, hidden, inter, top_k = 8, spec["hidden"], spec["inter"], spec["top_k"]
    rank, size = spec["ep"] or (0, 1)
    local = experts // size
    first = rank * local
    w13, dense13 = _experts(local, 2 * inter, hidden, spec["group"], seed=1)
    w2, dense2 = _experts(local, hidden, inter, spec["group"], seed=2)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(spec["tokens"], hidden, generator=generator).to(dtype)
    chosen = [0, 2, 3, 5, 6]  # experts 1, 4 and 7 are never chosen: their scales become NaN
    picks = torch.stack([torch.randperm(len(chosen), generator=generator)[:top_k] for _ in range(x.shape[0])])
    ids = torch.tensor(chosen)[picks]
    weights = torch.rand(x.shape[0], top_k, generator=generator)
    for expert in range(local):
        if first + expert not in chosen:
            w13.scale[expert] = float("nan")
            w2.scale[expert] = float("nan")
    if spec["decode"]:
        out = moe_decode(x, w13, w2, ids, weights, spec["act"], first_expert=first)
    else:
        w8a8 = spec["w8a8"] if "target" not in spec else None  # None: as the target runs it (W8A16)
        out = fused_moe_fp8(x, w13, w2, ids, weights, spec["act"], first_expert=first, w8a8=w8a8)
    seen = fake_quantize_groups if spec["w8a8"] else None  # what W8A8's products see of their inputs
    ref = _reference(x, dense13, dense2, ids, weights, spec["act"], first, local, seen)
    return case_result(spec, out, ref, x)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_in_interpreter(__file__, CASES)


@needs_triton
@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[json.dumps(c, separators=(",", ":")) for c in CASES]
)
def test_kernels_match_the_dequantized_experts(results: list[dict], index: int) -> None:
    assert_case_matches(results[index], CASES[index], TOLERANCE[CASES[index]["dtype"]])


@needs_triton
def test_bad_inputs_are_refused() -> None:
    from fitserve.kernels.capability import forced_target
    from fitserve.kernels.fused_moe import FusedMoeConfig, GemmTile
    from fitserve.kernels.fused_moe_fp8 import Fp8Experts, fused_moe_fp8
    from fitserve.kernels.moe_decode import SharedExpert, moe_decode

    data = torch.zeros(2, 64, 64, dtype=torch.float8_e4m3fn)
    w13 = Fp8Experts(data, torch.ones(2, 64, 1), 64)
    w2 = Fp8Experts(torch.zeros(2, 64, 32, dtype=torch.float8_e4m3fn), torch.ones(2, 64, 1), 32)
    ids, weights = torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \[T, hidden\] bfloat16/float16"):
        fused_moe_fp8(torch.zeros(2, 64), w13, w2, ids, weights, "silu")
    with pytest.raises(ValueError, match="weights must be float8_e4m3fn"):
        fused_moe_fp8(x, Fp8Experts(data.to(torch.bfloat16), w13.scale, 64), w2, ids, weights, "silu")
    with pytest.raises(ValueError, match=r"down must be \[E, hidden, I\] = \(2, 64, 32\)"):
        fused_moe_fp8(x, w13, w13, ids, weights, "silu")
    with pytest.raises(ValueError, match=r"gate_up scale must be float32 \[E, N, ceil\(K / group_k\)\]"):
        fused_moe_fp8(x, Fp8Experts(data, torch.ones(2, 64, 2), 64), w2, ids, weights, "silu")
    with pytest.raises(ValueError, match="group_k must be K = 64 or a multiple of 16, got 40"):
        fused_moe_fp8(x, Fp8Experts(data, torch.ones(2, 64, 2), 40), w2, ids, weights, "silu")
    with pytest.raises(ValueError, match="activation 'relu'"):
        fused_moe_fp8(x, w13, w2, ids, weights, "relu")
    with pytest.raises(ValueError, match="W8A8 needs a hidden size of whole 128-column groups, got 64"):
        fused_moe_fp8(x, w13, w2, ids, weights, "silu", w8a8=True)
    x128 = torch.zeros(2, 128, dtype=torch.bfloat16)
    w13_128 = Fp8Experts(torch.zeros(2, 64, 128, dtype=torch.float8_e4m3fn), torch.ones(2, 64, 1), 128)
    w2_128 = Fp8Experts(torch.zeros(2, 128, 32, dtype=torch.float8_e4m3fn), torch.ones(2, 128, 1), 32)
    tiles = FusedMoeConfig(16, GemmTile(64, 128), GemmTile(64, 128))
    with pytest.raises(ValueError, match="W8A8's gate_up block_n must be 128, got 64"):
        fused_moe_fp8(x128, w13_128, w2_128, ids, weights, "silu", config=tiles)
    with forced_target((8, 6)), pytest.raises(ValueError, match=r"needs fp8 tensor cores .* got \(8, 6\)"):
        fused_moe_fp8(x128, w13_128, w2_128, ids, weights, "silu", w8a8=True)
    shared = SharedExpert(torch.zeros(64, 64), torch.zeros(64, 32), torch.zeros(64))
    with pytest.raises(ValueError, match="fp8 experts take no shared expert here"):
        moe_decode(x, w13, w2, ids, weights, "silu", shared=shared)


if __name__ == "__main__":
    answer_cases(run_case)
