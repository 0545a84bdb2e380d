"""kernels/fp8_w8a16.py below compute capability 8.9 (forced sm_80 / sm_75 targets: the weight passed as its
bytes, decoded by kernels/fp8_bits.py) under Triton's CPU interpreter, against x @ the dequantized weight
and against the same kernel on a target with Triton's e4m3 conversion (sm_90): per-channel and 128-column
block scales. The two must agree to the bit: the bytes' decoding is exact. The kernel's own cases and its
split-K rule: tests/unit/test_fp8_w8a16_interpret.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.triton_interpreter import answer_cases, run_in_interpreter

CASES = [
    {"group": group, "target": target, "rows": rows}
    for group in (None, 128)
    for target, rows in (([9, 0], 3), ([8, 0], 3), ([7, 5], 16))
]


def run_case(spec: dict) -> dict:
    from fitserve.kernels.capability import forced_target
    from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear
    from fitserve.layers.quantization.fp8_weight import dequantize, random_fp8_weight

    weight = random_fp8_weight(64, 256, spec["group"], 0.05, torch.Generator().manual_seed(0))
    x = torch.randn(spec["rows"], 256, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    with forced_target(tuple(spec["target"])):
        out = fp8_w8a16_linear(x, weight.data, weight.scale)
    reference = x.float() @ dequantize(weight).t()
    error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
    return {"case": spec, "error": error, "out": out.float().flatten()[:64].tolist()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_in_interpreter(__file__, CASES)


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[json.dumps(c, separators=(",", ":")) for c in CASES]
)
def test_the_kernel_matches_the_dequantized_weight(results: list[dict], index: int) -> None:
    assert results[index]["case"] == CASES[index]
    assert results[index]["error"] <= 2**-9  # float16 output


def test_below_8_9_the_bytes_give_the_same_numbers(results: list[dict]) -> None:
    by_case = {(r["case"]["group"], tuple(r["case"]["target"]), r["case"]["rows"]): r["out"] for r in results}
    for group in (None, 128):
        assert by_case[(group, (8, 0), 3)] == by_case[(group, (9, 0), 3)]


if __name__ == "__main__":
    answer_cases(run_case)
