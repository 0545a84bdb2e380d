"""kernels/skinny_split_gemm.py (split-K for 1 to 16 rows and weights below skinny_gemm's 4,096 output
features) under Triton's CPU interpreter, against x @ W.T (+ bias) in float32: every config, split and
unsplit, a last split shorter than the others (K not a multiple of the split), a ragged N tile, a partly
masked last K step, float16 and bfloat16, with and without bias. Each call must come within the 16-bit
output's rounding of the float32 result, leave every split-K counter at 0 (so the next call, or a CUDA
graph's next replay, needs no memset), and a second call must give the same bits (it would find its
counters short of the split count otherwise). Also the shape rule of `takes_weight` on the models' weights,
the split rule, and the errors. Skipped where triton is not installed.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in one child process (this file
run as a script, tests/unit/triton_interpreter.py), on CPU tensors (`supports` is patched to take them);
the interpreter runs no PDL (no L2 prefetch, which changes no value).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import pytest
import torch

from tests.unit.triton_interpreter import run_in_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

H100_SMS = 132
# (rows, N, K, dtype, bias, config name, splits or None for choose_splits')
CASES = [
    (1, 256, 2048, "bfloat16", False, "n32k256", None),  # 8 tiles x 8 splits
    (16, 100, 528, "float16", True, "n16k256", None),  # ragged N; 3 steps, the last of 16 columns
    (7, 96, 2112, "bfloat16", True, "n32k128", 5),  # 17 steps: 4 splits of 4, a last one of 1
    (3, 64, 1024, "bfloat16", False, "n32k256", 1),  # unsplit: y written directly
    (5, 160, 784, "float16", False, "n64k128x2", None),  # K not a multiple of the step
    (16, 48, 4096, "bfloat16", True, "n16k256", 16),  # 16 splits of one step each
]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_in_interpreter(__file__, CASES)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_float32_within_the_output_rounding(results: list[dict[str, Any]], index: int) -> None:
    rows, out_features, in_features, dtype, _, _, splits = CASES[index]
    result = results[index]
    # float32 accumulation: only the rounding to 16 bits (half an ulp: 2^-9 of bf16, 2^-12 of fp16) and
    # the summation order differ from the float32 result
    tolerance = 2**-8 if dtype == "bfloat16" else 2**-11
    assert result["error"] <= tolerance, result
    assert result["counters_left"] == 0, result
    assert result["same_bits_again"], result
    if splits is not None:
        assert result["splits"] == splits, result
    else:
        assert result["splits"] > 1, result


def test_the_shape_rule_takes_the_small_weights_of_the_models() -> None:
    from fitserve.kernels.skinny_split_gemm import takes_weight

    taken = {
        "qwen3.6-35b-a3b router": (256, 2048),
        "qwen3.6-35b-a3b shared expert gate_up": (1024, 2048),
        "qwen3.6-35b-a3b shared expert down": (2048, 512),
        "qwen3.6-35b-a3b o_proj / out_proj": (2048, 4096),
        "qwen3.6-35b-a3b k / v": (512, 2048),
        "gemma-4 26b-a4b k / v": (2048, 2816),
        "gemma-4 26b-a4b router": (128, 2816),
        "llama-3.1-8b k / v": (1024, 4096),
    }
    left = {
        "skinny_gemm's (4,096 rows)": (4096, 4096),
        "gemma-4 26b-a4b o_proj (cuBLAS is faster at N 2816)": (2816, 4096),
        "gemma-4 26b-a4b down": (2816, 2112),
        "qwen3.6-35b-a3b in_proj_ba (0.25 MiB)": (64, 2048),
        "a short row": (2048, 256),
    }
    assert [name for name, shape in taken.items() if not takes_weight(*shape)] == []
    assert [name for name, shape in left.items() if takes_weight(*shape)] == []


@pytest.mark.parametrize(
    ("out_features", "in_features", "sms", "splits"),
    [
        (2048, 4096, 132, 8),  # 64 tiles: 8 splits of 2 steps, 512 programs (~4 an SM)
        (256, 2048, 132, 8),  # 8 tiles: one step a split (8 steps)
        (2816, 2112, 132, 5),  # 9 steps: 5 splits of 2, the last of 1 (6 would leave one empty)
        (2048, 512, 132, 2),
        (2816, 4096, 40, 1),  # a T4's 40 SMs: 88 tiles are more than 4 programs an SM's half
        (32 * 4097, 4096, 1 << 20, 1),  # more tiles than counters
    ],
)
def test_choose_splits(out_features: int, in_features: int, sms: int, splits: int) -> None:
    from fitserve.kernels.skinny_split_gemm import DEFAULT_CONFIG, choose_splits

    assert choose_splits(out_features, in_features, DEFAULT_CONFIG, sms) == splits


def test_refuses_what_it_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    from fitserve.kernels import skinny_split_gemm as module

    x = torch.zeros(17, 4096, dtype=torch.bfloat16)
    message = r"x \[M <= 16, K\].*got x \(17, 4096\).*use torch.nn.functional.linear"
    with pytest.raises(ValueError, match=message):
        module.skinny_split_gemm(x, torch.zeros(2048, 4096, dtype=torch.bfloat16))
    monkeypatch.setattr(module, "supports", lambda x, weight: True)
    x = torch.zeros(2, 4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs weight \[N, 4096\].*got weight \(2048, 2048\)"):
        module.skinny_split_gemm(x, torch.zeros(2048, 2048, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bias \(2047,\): pass matching shapes"):
        module.skinny_split_gemm(x, torch.zeros(2048, 4096, dtype=torch.bfloat16), torch.zeros(2047))
    with pytest.raises(ValueError, match=r"splits=17 must be 1 to 16 \(K 4096 in steps of 256\)"):
        module.skinny_split_gemm(x, torch.zeros(2048, 4096, dtype=torch.bfloat16), splits=17)


def _run_case(case: list[Any]) -> dict[str, Any]:
    from fitserve.kernels import skinny_split_gemm as module

    rows, out_features, in_features, dtype_name, with_bias, config_name, splits = case
    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = (0.02 * torch.randn(out_features, in_features, generator=generator)).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    expected = x.float() @ weight.float().T + (bias.float() if bias is not None else 0.0)
    config = module.CONFIGS[config_name]
    used = splits or module.choose_splits(out_features, in_features, config, H100_SMS)
    out = module.skinny_split_gemm(x, weight, bias, config=config, splits=splits)
    again = module.skinny_split_gemm(x, weight, bias, config=config, splits=splits)
    counters = module._counters(x.device)
    return {
        "error": ((out.float() - expected).abs().max() / expected.abs().max()).item(),
        "counters_left": int(counters.abs().sum()),
        "same_bits_again": torch.equal(out, again),
        "splits": used,
        "dtype": str(out.dtype),
    }


if __name__ == "__main__":
    import triton  # noqa: F401  (after TRITON_INTERPRET, before the kernels)

    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    # The kernel launches through fast_launch and takes CUDA tensors only: in the interpreter, the plain
    # kernel on the CPU tensors, with the H100's SM count.
    from fitserve.kernels import fast_launch

    fast_launch.fast_launch = lambda function: function
    from fitserve.kernels import skinny_split_gemm

    skinny_split_gemm.supports = lambda x, weight: True
    skinny_split_gemm.sm_count = lambda device: H100_SMS
    print(json.dumps([_run_case(case) for case in json.loads(sys.argv[1])]))
