"""The nf4 layout (plain torch, always runs) and the nf4 kernels (fused GEMM, dequantize + chunked GEMM)
under Triton's CPU interpreter at tiny shapes (skipped where triton is not installed; CI has no triton).

The kernels run in a child process (this file as a script, TRITON_INTERPRET=1; see
tests/unit/triton_interpreter.py). Reference: the bitsandbytes form dequantized in float32
(layers/quantization/bnb_weight.dequantize), then x.float() @ W.T.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fitserve.kernels.nf4_pack import check_blocksize, dequantize_packed, pack_nf4, pair_table
from fitserve.layers.quantization.bnb_weight import Nf4Weight, dequantize, random_nf4_weight
from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# |y - ref| <= TOLERANCE * max|ref|: absmax kept float16, the tensor-core kernel rounds each weight to x's
# dtype, y is rounded to it.
TOLERANCE = {"bfloat16": 2**-6, "float16": 2**-8}


def _weight(out_features: int, in_features: int, blocksize: int, seed: int, quant_type: str) -> Nf4Weight:
    generator = torch.Generator().manual_seed(seed)
    return random_nf4_weight(out_features, in_features, blocksize, 0.02, generator, quant_type=quant_type)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_pair_table_holds_both_codes_of_a_byte(quant_type: str) -> None:
    weight = _weight(16, 128, 64, 0, quant_type)
    table = pair_table(weight.code)
    byte = 0x3C
    low = int(table[byte]) & 0xFFFFFFFF
    high = (int(table[byte]) >> 32) & 0xFFFFFFFF
    as_float = torch.tensor([low, high], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert as_float.tolist() == [weight.code[3].item(), weight.code[12].item()]


@pytest.mark.parametrize("blocksize", [32, 64, 256])
def test_packed_dequantizes_to_the_reference(blocksize: int) -> None:
    weight = _weight(48, 512, blocksize, 1, "nf4")
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, blocksize, torch.bfloat16)
    assert packed.scales.dtype == torch.float16 and packed.scales.shape == (48, 512 // blocksize)
    assert not packed.counters.any()
    torch.testing.assert_close(dequantize_packed(packed), dequantize(weight), rtol=2**-10, atol=1e-7)


def test_tiny_absmax_keeps_float32_scales() -> None:
    weight = _weight(16, 128, 64, 2, "nf4")
    weight.absmax[0, 0] = 1e-6  # float16 would lose it
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, 64, torch.float16)
    assert packed.scales.dtype == torch.float32


@pytest.mark.parametrize(("in_features", "blocksize"), [(256, 48), (200, 64), (256, 16)])
def test_block_sizes_the_kernels_do_not_take_are_refused(in_features: int, blocksize: int) -> None:
    with pytest.raises(ValueError, match=f"got {blocksize}"):
        check_blocksize(in_features, blocksize)


# (rows, N, K, blocksize, dtype, bias, quant_type, path[, lookup]): the gemv (1 row; K not a multiple of
# 256; blocks spanning steps), the dot kernel (2..64 rows, split-K; 65+ rows), the chunked dequantize +
# GEMM; the default lookup (tl.gather), the select tree and the two gathers from memory
# (nf4_gemm.Nf4Config.lookup).
CASES = [
    [1, 48, 512, 64, "bfloat16", True, "nf4", "fused", 0],
    [3, 48, 256, 64, "float16", False, "fp4", "fused", 0],
    [1, 32, 256, 32, "bfloat16", False, "nf4", "fused", 1],
    [4, 16, 256, 128, "bfloat16", False, "nf4", "fused", 1],
    [1, 16, 256, 128, "float16", True, "fp4", "fused", 3],
    [2, 32, 256, 64, "bfloat16", False, "nf4", "fused", 3],
    [1, 16, 512, 32, "float16", False, "fp4", "fused", 2],
    [1, 48, 512, 64, "bfloat16", False, "nf4", "fused"],
    [1, 32, 320, 32, "float16", True, "fp4", "fused"],
    [1, 16, 1024, 512, "bfloat16", False, "nf4", "fused"],
    [3, 48, 256, 64, "bfloat16", True, "nf4", "fused"],
    [20, 64, 512, 128, "float16", False, "nf4", "fused"],
    [70, 32, 256, 64, "bfloat16", False, "fp4", "fused"],
    [9, 160, 256, 64, "bfloat16", True, "nf4", "chunked"],
    [5, 48, 512, 256, "float16", False, "nf4", "chunked"],
]


@needs_triton
def test_kernels_match_the_dequantized_reference() -> None:
    results = run_in_interpreter(__file__, CASES)
    for result in results:
        tolerance = TOLERANCE[result["case"][4]]
        assert result["shape_ok"], result
        assert result["error"] <= tolerance, result
        assert result["counters_zero"], result
        assert result["repeat_equal"], result


def _run_case(case: list) -> dict:
    from dataclasses import replace

    from fitserve.kernels.capability import DEFAULT_SM_COUNT
    from fitserve.kernels.nf4_dequant import chunked_nf4_linear
    from fitserve.kernels.nf4_gemm import choose_config, nf4_linear

    rows, out_features, in_features, blocksize, dtype_name, with_bias, quant_type, path = case[:8]
    dtype = getattr(torch, dtype_name)
    weight = _weight(out_features, in_features, blocksize, rows, quant_type)
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, blocksize, dtype)
    generator = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    config = choose_config(rows, out_features, in_features, blocksize, DEFAULT_SM_COUNT)
    if len(case) > 8:
        config = replace(config, lookup=case[8])
    if path == "fused":
        run = lambda: nf4_linear(x, packed, bias, config)  # noqa: E731
    else:  # scratch for 128 rows: the 160-row weight takes two chunks (128, 32); 48 rows fit in one
        run = lambda: chunked_nf4_linear(x, packed, bias, scratch_bytes=128 * in_features * 2)  # noqa: E731
    y = run()
    reference = x.float() @ dequantize(weight).T + (bias.float() if with_bias else 0.0)
    scale = reference.abs().max().item()
    return {
        "case": case,
        "error": (y.float() - reference).abs().max().item() / scale,
        "counters_zero": not packed.counters.any(),
        "repeat_equal": torch.equal(y, run()),
        "shape_ok": tuple(y.shape) == (rows, out_features) and y.dtype == dtype,
    }


if __name__ == "__main__":
    from tests.unit.triton_interpreter import answer_cases

    answer_cases(_run_case)
