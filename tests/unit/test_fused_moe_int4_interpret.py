"""The int4 fused MoE (fitserve/kernels/fused_moe_int4.py) under Triton's interpreter on the CPU, tiny shapes,
against the dequantized experts (rounded to the activation dtype) through fused_moe's arithmetic in torch
(skipped where triton is not installed; CI installs only torch). The kernels run in a child process (this
file as a script, TRITON_INTERPRET=1; tests/unit/triton_interpreter.py).

Shapes: K of one partial 256-code block and of two (the second padded), groups of 32 and 64, the
decode-sized tiles (up to 64 tokens) and the larger ones, expert parallel (pairs routed to another rank's
experts add nothing), experts no token chose holding NaN scales (reading one would spoil the output).
Both paths: fused_moe_int4 as it dispatches ("auto": decode-sized batches on kernels/moe_int4_decode.py),
the grouped path forced at a decode-sized batch, and the decode kernels with the down kernel's slots split
over programs (the partials and the counter of moe_decode.sum_split_partials).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_interpreter import (
    answer_cases,
    assert_case_matches,
    case_result,
    random_int4,
    run_in_interpreter,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
TOLERANCE = {"bfloat16": 2**-7, "float16": 2**-9}  # |out - ref| <= TOLERANCE * max|ref|
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def case(
    tokens: int, dtype: str = "bfloat16", hidden: int = 64, inter: int = 64, group: int = 32, **extra
) -> dict:
    return {"tokens": tokens, "dtype": dtype, "hidden": hidden, "inter": inter, "group": group, "top_k": 2,
            "act": "silu", "ep": None, **extra}  # fmt: skip


CASES = [
    case(1),
    case(5, "float16", group=64),
    case(3, hidden=320, inter=64, top_k=3),  # two 256-code blocks of hidden, the second padded
    case(70, hidden=64, inter=96, act="gelu_tanh"),  # the larger tiles; I of one partial block
    case(9, ep=[1, 2]),
    case(1, path="grouped"),
    case(2, inter=96, act="gelu_tanh", path="decode", slots_per_split=1),  # I of one partial block, split
    case(4, "float16", hidden=320, top_k=3, ep=[1, 2], path="decode", slots_per_split=2),
    case(2, hidden=1024, inter=512, group=512),  # groups over two 256-code blocks
    # one group per row (per channel) over two blocks
    case(1, "float16", hidden=320, inter=320, group=320, path="decode", slots_per_split=None),
]


def stack_experts(packed: list) -> Any:
    """The experts' PackedInt4 (one projection each) stacked as the kernels take them."""
    from fitserve.kernels.fused_moe_int4 import PackedExperts

    first = packed[0]
    qweight = torch.stack([p.qweight for p in packed])
    scale_zero = torch.stack([p.scale_zero for p in packed])
    return PackedExperts(qweight, scale_zero, first.group_size, first.in_features, first.out_features)


def _reference(x, w13, w2, ids, weights, act, first_expert, local_experts, seen=None) -> torch.Tensor:
    """Each pair's act(gate) * up rounded to x's dtype, each weighted row rounded, a token's rows summed in
    float32. `seen` (W8A8: layers/moe_fp8.fake_quantize_groups): what the products see of x and of the
    float32 act(gate) * up, which is then not rounded."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    intermediate = w13.shape[1] // 2
    x_seen = x.float() if seen is None else seen(x.float())
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot]) - first_expert
            if not 0 <= expert < local_experts:
                continue
            gate_up = x_seen[token] @ w13[expert].float().t()
            mid = ACTIVATIONS[act](gate_up[:intermediate]) * gate_up[intermediate:]
            mid = mid.to(x.dtype).float() if seen is None else seen(mid)
            row = (mid @ w2[expert].float().t()) * weights[token, slot]
            out[token] += row.to(x.dtype).float()
    return out.to(x.dtype)


def run_case(spec: dict) -> dict:
    from fitserve.kernels.fused_moe_int4 import fused_moe_int4, grouped_moe_int4
    from fitserve.kernels.int4_repack import dequantize_words, repack_int4
    from fitserve.kernels.moe_int4_decode import Int4DecodeConfig, moe_int4_decode

    dtype = getattr(torch, spec["dtype"])
    experts, hidden, inter, group, top_k = 8, spec["hidden"], spec["inter"], spec["group"], spec["top_k"]
    rank, size = spec["ep"] or (0, 1)
    local = experts // size
    first = rank * local
    gate_up = [
        repack_int4(*random_int4(2 * inter, hidden, group, seed=e), group, dtype) for e in range(local)
    ]
    down = [repack_int4(*random_int4(hidden, inter, group, seed=100 + e), group, dtype) for e in range(local)]
    w13, w2 = stack_experts(gate_up), stack_experts(down)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(spec["tokens"], hidden, generator=generator).to(dtype)
    chosen = [0, 2, 3, 5, 6]  # experts 1, 4 and 7 are never chosen: their scales become NaN
    picks = torch.stack([torch.randperm(len(chosen), generator=generator)[:top_k] for _ in range(x.shape[0])])
    ids = torch.tensor(chosen)[picks]
    weights = torch.rand(x.shape[0], top_k, generator=generator)
    dense13 = torch.stack([dequantize_words(p.qweight, p.scale_zero, hidden, group) for p in gate_up]).to(
        dtype
    )
    dense2 = torch.stack([dequantize_words(p.qweight, p.scale_zero, inter, group) for p in down]).to(dtype)
    for expert in range(local):
        if first + expert not in chosen:
            w13.scale_zero[expert] = float("nan")
            w2.scale_zero[expert] = float("nan")
    path = spec.get("path", "auto")
    if path == "auto":
        out = fused_moe_int4(x, w13, w2, ids, weights, spec["act"], first_expert=first)
    elif path == "grouped":
        out = grouped_moe_int4(x, w13, w2, ids, weights.float(), spec["act"], first_expert=first)
    else:
        config = Int4DecodeConfig(down_slots_per_split=spec["slots_per_split"])
        out = moe_int4_decode(x, w13, w2, ids, weights.float(), spec["act"], first, config)
    ref = _reference(x, dense13, dense2, ids, weights, spec["act"], first, local)
    return case_result(spec, out, ref, x)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_in_interpreter(__file__, CASES)


@needs_triton
@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[json.dumps(c, separators=(",", ":")) for c in CASES]
)
def test_kernel_matches_the_dequantized_experts(results: list[dict], index: int) -> None:
    assert_case_matches(results[index], CASES[index], TOLERANCE[CASES[index]["dtype"]])


@needs_triton
def test_bad_inputs_are_refused() -> None:
    from fitserve.kernels.fused_moe_int4 import fused_moe_int4
    from fitserve.kernels.int4_repack import repack_int4

    w13 = stack_experts([repack_int4(*random_int4(64, 64, 32), 32, torch.bfloat16)] * 2)
    w2 = stack_experts([repack_int4(*random_int4(64, 32, 32), 32, torch.bfloat16)] * 2)
    ids, weights = torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"x must be \[T, hidden\] bfloat16/float16"):
        fused_moe_int4(torch.zeros(2, 64), w13, w2, ids, weights, "silu")
    with pytest.raises(ValueError, match="scales must be in x's dtype"):
        fused_moe_int4(torch.zeros(2, 64, dtype=torch.float16), w13, w2, ids, weights, "silu")
    with pytest.raises(ValueError, match=r"down must be \[E, hidden=64, I=32\]"):
        fused_moe_int4(torch.zeros(2, 64, dtype=torch.bfloat16), w13, w13, ids, weights, "silu")
    with pytest.raises(ValueError, match="activation 'relu'"):
        fused_moe_int4(torch.zeros(2, 64, dtype=torch.bfloat16), w13, w2, ids, weights, "relu")


if __name__ == "__main__":
    answer_cases(run_case)
