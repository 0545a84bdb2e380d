"""The int4 repack (plain torch, always runs) and the int4 GEMM kernels under Triton's interpreter on the
CPU at tiny shapes (skipped where triton is not installed; CI installs only torch).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child process: this
file run as a script (`python tests/unit/test_int4_gemm_interpret.py CASES_JSON`) with the variable set.
That child patches two gaps of Triton 3.6's interpreter (not of the kernels): with numpy >= 2.4 a loop
bound computed in the kernel cannot be turned into a Python int (its scalars are 1-element arrays),
and tl.dot multiplies bfloat16's storage (uint16) as integers and float32 -> bfloat16 truncates; the
GPU rounds to nearest even, so the child does too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fitserve.kernels.int4_repack import (
    BLOCK_K,
    check_group_size,
    dequantize_packed,
    dequantize_reference,
    repack_int4,
    unpack_codes,
)
from tests.unit.triton_interpreter import random_int4
from tests.unit.triton_interpreter import run_in_interpreter as run_script_in_interpreter

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# |y - ref| <= TOLERANCE * max|ref|, ref = x.float() @ dequantize_reference(...).T: scales and zero points
# are kept in the activation dtype, the tensor-core kernel rounds each weight to it, y is rounded to it.
TOLERANCE = {"bfloat16": 2**-6, "float16": 2**-8}


# --- repack: plain torch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    [(48, 512, 32), (16, 256, 64), (80, 1024, 128), (48, 288, 32), (16, 288, 288), (32, 4096, 4096)],
)
def test_repack_round_trip(out_features: int, in_features: int, group_size: int) -> None:
    codes, scales, zeros = random_int4(out_features, in_features, group_size)
    packed = repack_int4(codes, scales, zeros, group_size, torch.bfloat16)
    padded = -(-in_features // BLOCK_K) * BLOCK_K
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (out_features, padded // 8)
    assert torch.equal(unpack_codes(packed), codes)
    groups = in_features // group_size
    assert packed.scales.shape[1] == out_features and packed.scales.dtype == torch.bfloat16
    assert torch.equal(packed.scales[:groups], scales.t().to(torch.bfloat16))
    assert torch.equal(packed.zeros[:groups], zeros.t().to(torch.bfloat16))
    assert not packed.scales[groups:].any()  # padded groups weigh nothing
    assert not packed.counters.any()


def test_layout_word_holds_nibble_j_of_32_consecutive_codes() -> None:
    codes = torch.zeros(2, 512, dtype=torch.uint8)
    codes[1, 256 + 32 * 5 + 7] = 0xB  # block 1, nibble 5, word 7
    packed = repack_int4(codes, torch.ones(2, 4), torch.zeros(2, 4), 128, torch.float16)
    words = packed.qweight[1].to(torch.int64) & 0xFFFFFFFF
    assert int(words[32 + 7]) == 0xB << 20 and int(words.count_nonzero()) == 1


def test_dequantize_reference_is_the_affine_formula() -> None:
    codes, scales, zeros = random_int4(16, 128, 32)
    expected = torch.empty(16, 128)
    for n in range(16):
        for k in range(128):
            expected[n, k] = (codes[n, k].item() - zeros[n, k // 32].item()) * scales[n, k // 32].item()
    torch.testing.assert_close(dequantize_reference(codes, scales, zeros, 32), expected, rtol=0, atol=1e-7)
    packed = repack_int4(codes, scales, zeros, 32, torch.float16)
    torch.testing.assert_close(dequantize_packed(packed), expected, rtol=2**-10, atol=1e-6)


def test_bad_inputs_are_refused() -> None:
    codes, scales, zeros = random_int4(16, 256, 64)
    with pytest.raises(ValueError, match="group size"):
        check_group_size(256, 96)
    with pytest.raises(ValueError, match="group size"):
        repack_int4(codes, scales[:, :2], zeros[:, :2], 128 + 64, torch.bfloat16)
    with pytest.raises(ValueError, match="4-bit"):
        repack_int4(codes * 2, scales, zeros, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        repack_int4(codes, scales[:, :1], zeros, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        repack_int4(codes, scales, zeros, 64, torch.float32)


# Llama-3.1-8B qkv / o / gate_up / down and Llama-3.3-70B qkv / o / gate_up / down as (N, K), with the
# splits choose_config gives them on 132 SMs at 1 row (the CUDA-core kernel) and at 4 to 16 rows (the
# tensor-core kernel): the fastest or within 5% of it on an H200 and an H100 (benchmarks/results/
# h*_batch1_split_sweep.json, h100_int4_small_batch_splits.json), but for the 70B's gate_up at 4 to 16
# rows, where 2 splits measured 111.3 us against the rule's 1 split's 130.6 (H100, 4 rows).
SPLIT_CASES = [
    ((6144, 4096), 4, 4),
    ((4096, 4096), 8, 8),
    ((28672, 4096), 1, 1),
    ((4096, 14336), 8, 8),
    ((10240, 8192), 3, 3),
    ((8192, 8192), 4, 4),
    ((57344, 8192), 1, 1),
    ((8192, 28672), 4, 4),
]


@needs_triton
@pytest.mark.parametrize(("shape", "splits", "_"), SPLIT_CASES)
def test_one_row_takes_the_cuda_core_kernel_split_into_equal_parts(shape, splits: int, _) -> None:
    from fitserve.kernels.int4_gemm import GEMV_PROGRAMS_PER_SM, choose_config

    out_features, in_features = shape
    config = choose_config(1, out_features, in_features, 132)
    assert (config.kernel, config.block_n, config.num_warps, config.num_stages) == ("gemv", 64, 2, 3)
    assert config.split_k == splits
    blocks = in_features // 256
    part = -(-blocks // splits)
    assert (out_features // 64) * splits <= max(GEMV_PROGRAMS_PER_SM * 132, out_features // 64)
    assert blocks - (splits - 1) * part >= part - 1  # no short last split (16 blocks: never 6 splits)


@needs_triton
@pytest.mark.parametrize(("shape", "_", "splits"), SPLIT_CASES)
@pytest.mark.parametrize("rows", [4, 16])
def test_small_batches_split_the_tensor_core_kernel_into_equal_parts(
    shape, _, splits: int, rows: int
) -> None:
    from fitserve.kernels.int4_gemm import choose_config

    config = choose_config(rows, *shape, 132)
    assert (config.kernel, config.block_m, config.block_n, config.split_k) == ("dot", 16, 128, splits)


# --- kernels under the interpreter (child process) -------------------------------------------------

# (rows, out_features, in_features, group_size, dtype, bias, config or None for choose_config's
#  [, integer zero points: default True])
GROUP_CASES = [
    (rows, 48, in_features, group_size, dtype, rows == 3, None)
    for rows in (1, 3, 16, 17, 64, 257)
    for in_features, group_size in ((512, 32), (512, 64), (512, 128), (512, 512), (288, 32), (288, 288))
    for dtype in ("bfloat16", "float16")
    if (rows + group_size + len(dtype)) % 2 == 0 or rows in (1, 17)  # half the pairs; rows 1 / 17 all
]
CONFIG_CASES = [
    (2, 80, 1024, 128, "float16", True, {"kernel": "gemv", "block_m": 2, "block_n": 16, "split_k": 3}),
    (4, 48, 512, 64, "bfloat16", False, {"kernel": "gemv", "block_m": 4, "block_n": 64, "split_k": 2}),
    (1, 48, 1024, 1024, "bfloat16", False, {"kernel": "gemv", "block_m": 1, "block_n": 32, "split_k": 4}),
    (9, 48, 512, 32, "float16", True, {"kernel": "dot", "block_m": 16, "block_n": 16, "split_k": 2}),
    (9, 48, 768, 128, "bfloat16", False, {"kernel": "dot", "block_m": 16, "block_n": 32, "swap_ab": True}),
    (33, 48, 512, 64, "float16", False, {"kernel": "dot", "block_m": 16, "block_n": 16, "group_m": 2}),
    (64, 48, 512, 128, "bfloat16", True, {"kernel": "dot", "block_m": 64, "block_n": 16, "split_k": 2}),
    # one tl.dot of depth 256 per block (the 8 slices joined and reordered)
    (5, 48, 512, 32, "bfloat16", False, {"kernel": "dot", "block_m": 16, "block_n": 16, "wide_k": True}),
    (40, 48, 288, 288, "float16", True, {"kernel": "dot", "block_m": 16, "block_n": 32, "wide_k": True}),
    (
        17,
        80,
        768,
        64,
        "float16",
        False,
        {"kernel": "dot", "block_m": 32, "block_n": 16, "wide_k": True, "swap_ab": True, "split_k": 2},
    ),
    # fractional zero points: the decode kernel's other path (sum x and z * sum x per group)
    (1, 48, 512, 64, "float16", False, {"kernel": "gemv", "block_m": 1, "block_n": 16}, False),
    (3, 48, 288, 32, "float16", True, {"kernel": "gemv", "block_m": 4, "block_n": 16, "split_k": 2}, False),
    (1, 48, 512, 512, "bfloat16", False, None, False),
    (20, 48, 512, 128, "float16", False, None, False),
]


def run_in_interpreter(cases) -> list:
    return run_script_in_interpreter(__file__, cases)


def assert_within_tolerance(results: list[dict]) -> None:
    failed = [r for r in results if r["error"] > TOLERANCE[r["case"][4]]]
    assert not failed, failed
    assert all(r["counters_zero"] for r in results)
    assert all(r["repeat_equal"] and r["shape_ok"] for r in results)


@needs_triton
def test_kernels_match_dequantized_reference_at_every_group_size() -> None:
    assert_within_tolerance(run_in_interpreter(GROUP_CASES))


@needs_triton
def test_every_kernel_and_split_matches_dequantized_reference() -> None:
    results = run_in_interpreter(CONFIG_CASES)
    assert_within_tolerance(results)
    # float16 leaves only the output's rounding against the reference with 16-bit scales
    for r in results:
        if r["case"][4] == "float16":
            assert r["error_vs_packed"] <= 2**-10, r


BAD_CONFIGS = [
    ({"kernel": "gemv", "block_m": 1, "block_n": 64}, 2, "at most block_m rows"),
    ({"kernel": "dot", "block_m": 8, "block_n": 64}, 5, "block_m and block_n >= 16"),
    ({"kernel": "dot", "block_m": 16, "block_n": 48}, 5, "powers of two"),
    ({"kernel": "wgmma", "block_m": 16, "block_n": 64}, 5, "'gemv', 'dot' or 'mma'"),
    ({"kernel": "mma", "block_m": 4, "block_n": 64}, 2, "block_m 8 or 16"),
    ({"kernel": "mma", "block_m": 8, "block_n": 64}, 9, "at most block_m rows"),
    ({"kernel": "mma", "block_m": 8, "block_n": 32}, 2, "16 rows x num_warps"),
    # the interpreter cannot run it (inline PTX): refused, not launched
    ({"kernel": "mma", "block_m": 8, "block_n": 64}, 2, "SM 8.0+ GPU"),
]


@needs_triton
def test_bad_configs_are_refused() -> None:
    messages = run_in_interpreter("bad-configs")
    for (_, _, expected), message in zip(BAD_CONFIGS, messages):
        assert message is not None and expected in message, message


# --- the child ---------------------------------------------------------------------------------------


def _config_error(config: dict, rows: int) -> str | None:
    from fitserve.kernels.int4_gemm import Int4GemmConfig, int4_linear

    codes, scales, zeros = random_int4(64, 256, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    try:
        int4_linear(torch.zeros(rows, 256, dtype=torch.bfloat16), packed, config=Int4GemmConfig(**config))
    except ValueError as error:
        return str(error)
    return None


def _run_case(case: list) -> dict:
    from fitserve.kernels.int4_gemm import Int4GemmConfig, int4_linear

    rows, out_features, in_features, group_size, dtype_name, with_bias, config = case[:7]
    integer_zeros = case[7] if len(case) > 7 else True
    dtype = getattr(torch, dtype_name)
    codes, scales, zeros = random_int4(out_features, in_features, group_size, rows, integer_zeros)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    assert packed.integer_zeros == integer_zeros
    generator = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    config = Int4GemmConfig(**config) if config else None
    y = int4_linear(x, packed, bias, config=config)
    extra = bias.float() if with_bias else 0.0
    reference = x.float() @ dequantize_reference(codes, scales, zeros, group_size).T + extra
    packed_reference = x.float() @ dequantize_packed(packed).T + extra
    scale = reference.abs().max().item()
    return {
        "case": case,
        "error": (y.float() - reference).abs().max().item() / scale,
        "error_vs_packed": (y.float() - packed_reference).abs().max().item() / scale,
        "counters_zero": not packed.counters.any(),
        "repeat_equal": torch.equal(y, int4_linear(x, packed, bias, config=config)),
        "shape_ok": tuple(y.shape) == (rows, out_features) and y.dtype == dtype,
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    request = json.loads(sys.argv[1])
    if request == "bad-configs":
        print(json.dumps([_config_error(*case[:2]) for case in BAD_CONFIGS]))
    else:
        print(json.dumps([_run_case(case) for case in request]))
