"""kernels/fp8_w8a16.py (the few-row fp8 GEMM of decode) under Triton's CPU interpreter at tiny shapes, and
its split-K rule (plain Python, always runs). The kernel runs in a child process (this file as a script,
TRITON_INTERPRET=1; tests/unit/triton_interpreter.py). Reference: x.float() @ (w.float() * scale).T.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fitserve.kernels.grid_math import cdiv
from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# (rows, N, K, scales per row (1: per channel, else 128-column blocks), dtype, config or None, counters):
# one split without counters; the rule's split with them; explicit splits, one leaving the last split a
# step short (5 steps in 3 splits of 2), with per-channel and block scales.
CASES = [
    [1, 64, 1024, 1, "bfloat16", None, False],
    [1, 64, 1024, 1, "bfloat16", None, True],
    [3, 48, 1280, 1, "float16", [32, 256, 4, 4, 3], True],
    [1, 32, 1024, 8, "bfloat16", [32, 128, 4, 3, 4], True],
    [16, 64, 640, 5, "bfloat16", [32, 128, 4, 3, 2], True],
]


@needs_triton
def test_fp8_kernel_matches_the_dequantized_reference_split_or_not() -> None:
    for result in run_in_interpreter(__file__, CASES):
        assert result["shape_ok"], result
        assert result["error"] <= 2**-7, result
        assert result["counters_zero"], result
        assert result["repeat_equal"], result


@needs_triton
def test_too_few_counters_are_refused_before_launch() -> None:
    pytest.importorskip("triton")
    from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear

    weight = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"need at least 2 int32 counters, got 1 .*split_counters\(64"):
        fp8_w8a16_linear(
            torch.zeros(1, 256), weight, torch.ones(64, 1), counters=torch.zeros(1, dtype=torch.int32)
        )


@needs_triton
@pytest.mark.parametrize(
    ("out_features", "in_features", "splits"),
    # Llama-3.1-8B qkv / o / gate_up / down, Llama-3.3-70B o / down, on 132 SMs, BLOCK_N 32, BLOCK_K 256
    [(6144, 4096, 2), (4096, 4096, 4), (28672, 4096, 1), (4096, 14336, 4), (8192, 8192, 2), (8192, 28672, 2)],
)
def test_split_rule_fills_one_wave_with_equal_parts(out_features: int, in_features: int, splits: int) -> None:
    from fitserve.kernels.fp8_w8a16 import PROGRAMS_PER_SM, choose_splits

    chosen = choose_splits(out_features, in_features, 32, 256, 132)
    assert chosen == splits
    steps = cdiv(in_features, 256)
    part = cdiv(steps, chosen)
    assert cdiv(out_features, 32) * chosen <= max(PROGRAMS_PER_SM * 132, cdiv(out_features, 32))
    assert steps - (chosen - 1) * part >= part - 1  # the last part at most one step short


def _run_case(case: list) -> dict:
    from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear, split_counters

    rows, out_features, in_features, groups, dtype_name, config, with_counters = case
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.3).to(torch.float8_e4m3fn)
    scale = 0.5 + torch.rand(out_features, groups, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    counters = split_counters(out_features, "cpu") if with_counters else None
    run = lambda: fp8_w8a16_linear(x, weight, scale, tuple(config) if config else None, counters)  # noqa: E731
    y = run()
    full_scale = scale.repeat_interleave(in_features // groups, dim=1) if groups > 1 else scale
    reference = x.float() @ (weight.float() * full_scale).T
    return {
        "case": case,
        "error": (y.float() - reference).abs().max().item() / reference.abs().max().item(),
        "counters_zero": counters is None or not counters.any(),
        "repeat_equal": torch.equal(y, run()),
        "shape_ok": tuple(y.shape) == (rows, out_features) and y.dtype == dtype,
    }


if __name__ == "__main__":
    from tests.unit.triton_interpreter import answer_cases

    answer_cases(_run_case)
