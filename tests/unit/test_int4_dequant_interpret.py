"""The int4 dequantization kernel (kernels/int4_dequant.py) and the chunked int4 linear that prefill runs
on it, under Triton's interpreter on the CPU at tiny shapes (skipped where triton is not installed; CI
installs only torch). Plain-torch helpers (chunk sizes) are tested where triton is installed too, since
the module imports triton.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child process: this
file run as a script (`python tests/unit/test_int4_dequant_interpret.py CASES_JSON`) with the variable
set. The child patches two gaps of Triton 3.6's interpreter (not of the kernels): with numpy >= 2.4 a
loop bound computed in the kernel is a 1-element array that `int()` refuses, and float32 -> bfloat16
truncates where the GPU rounds to nearest even (and tl.dot, which the fused path at few rows uses,
multiplies bfloat16's storage as integers).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.triton_interpreter import random_int4
from tests.unit.triton_interpreter import run_in_interpreter as run_script_in_interpreter

REPO = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# |y - ref| <= TOLERANCE * max|ref| for the linear (as tests/unit/test_int4_gemm_interpret.py)
TOLERANCE = {"bfloat16": 2**-6, "float16": 2**-8}
# dequantized weights against dequantize_packed (scales and zero points as stored), rounded once
WEIGHT_RTOL = {"bfloat16": 2**-8, "float16": 2**-11}


# (out_features, in_features, group_size, dtype, row_start, row_count, block_n, blocks_per_program,
#  integer zero points)
DEQUANT_CASES = [
    (48, 512, 32, "bfloat16", 0, 48, 16, 1, True),
    (48, 512, 64, "float16", 5, 37, 16, 2, False),
    (40, 768, 128, "bfloat16", 16, 24, 32, 2, True),
    (40, 288, 32, "float16", 3, 30, 16, 1, True),  # K not a multiple of 256
    (24, 288, 288, "bfloat16", 1, 7, 8, 1, False),  # per-channel, K not a multiple of 256
    (32, 1024, 1024, "float16", 0, 32, 16, 4, True),  # per-channel across blocks
    (32, 1024, 512, "bfloat16", 8, 16, 16, 3, True),  # a group of two blocks; uneven last program
]
# (rows, out_features, in_features, group_size, dtype, bias, scratch_bytes): Int4GpuLinearMethod.apply
# with the fused path up to 4 rows, the scratch capped at scratch_bytes and CHUNK_ALIGN 16 (several chunks)
APPLY_CASES = [
    (3, 48, 512, 64, "bfloat16", True, 1 << 20),  # fused
    (9, 48, 512, 64, "bfloat16", True, 1 << 20),  # one chunk: W fits
    (9, 80, 512, 32, "float16", False, 16 * 512 * 2 * 2),  # chunks of 32 rows: 32, 32, 16
    (6, 72, 288, 288, "bfloat16", True, 16 * 288 * 2 * 3),  # chunks of 48: 48, 24; K not a multiple
    (7, 64, 256, 128, "float16", True, 16 * 256 * 2 * 2),  # 2 chunks of 32 exactly
]


def run_in_interpreter(request) -> list:
    return run_script_in_interpreter(__file__, request)


@needs_triton
def test_dequantize_rows_matches_the_packed_weights() -> None:
    results = run_in_interpreter({"dequant": DEQUANT_CASES})
    assert len(results) == len(DEQUANT_CASES)
    for result in results:
        dtype = result["case"][3]
        assert result["untouched_ok"], result  # nothing outside the rows and K columns is written
        assert result["equal_to_packed"], result
        assert result["error_vs_packed"] <= WEIGHT_RTOL[dtype], result
        assert result["error_vs_reference"] <= TOLERANCE[dtype], result


@needs_triton
def test_apply_fused_and_chunked_match_the_reference() -> None:
    results = run_in_interpreter({"apply": APPLY_CASES})
    assert len(results) == len(APPLY_CASES)
    for result in results:
        assert result["shape_ok"], result
        assert result["error"] <= TOLERANCE[result["case"][4]], result
    assert [r["chunks"] for r in results] == [0, 1, 3, 2, 2]


@needs_triton
def test_chunk_rows_rule() -> None:
    results = run_in_interpreter("chunk-rows")
    # Llama-3.1-8B, bf16, 64 MiB: gate_up 4 chunks of 7168 rows, down 2 of 2048, qkv whole (48 MiB)
    assert results == [7168, 2048, 6144, 0, 512]


@needs_triton
def test_bad_outputs_are_refused() -> None:
    messages = run_in_interpreter("bad-outputs")
    assert all(message is not None and "dequantize_rows writes rows" in message for message in messages)


# --- the child ---------------------------------------------------------------------------------------


def _dequant_case(case: list) -> dict:
    from fitserve.kernels.int4_dequant import DequantConfig, dequantize_rows
    from fitserve.kernels.int4_repack import dequantize_packed, dequantize_reference, repack_int4

    out_features, in_features, group_size, dtype_name, start, count, block_n, per_program, int_zeros = case
    dtype = getattr(torch, dtype_name)
    codes, scales, zeros = random_int4(out_features, in_features, group_size, out_features + start, int_zeros)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    # a scratch view with a wider row stride, pre-filled: what is outside rows x K must stay as it was
    canvas = torch.full((count + 1, in_features + 24), 3.0, dtype=dtype)
    out = canvas[:count, 8 : 8 + in_features]
    dequantize_rows(packed, start, count, out, DequantConfig(block_n, per_program))
    expected = dequantize_packed(packed)[start : start + count]
    reference = dequantize_reference(codes, scales, zeros, group_size)[start : start + count]
    mask = torch.ones_like(canvas, dtype=torch.bool)
    mask[:count, 8 : 8 + in_features] = False
    scale = reference.abs().max().item()
    return {
        "case": case,
        "error_vs_packed": ((out.float() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item(),
        "error_vs_reference": (out.float() - reference).abs().max().item() / scale,
        "untouched_ok": bool((canvas[mask] == 3.0).all()),
        "equal_to_packed": torch.equal(out, expected.to(dtype)),  # the same float32 formula, rounded once
    }


def _apply_case(case: list) -> dict:
    import fitserve.kernels.int4_dequant as int4_dequant
    import fitserve.layers.quantization.int4_cpu as int4_cpu
    from fitserve.kernels.int4_repack import dequantize_reference, repack_int4

    rows, out_features, in_features, group_size, dtype_name, with_bias, scratch_bytes = case
    dtype = getattr(torch, dtype_name)
    int4_cpu.Int4GpuLinearMethod.fused_max_rows = 4
    int4_dequant.SCRATCH_BYTES = scratch_bytes
    int4_dequant.CHUNK_ALIGN = 16
    int4_dequant._scratch.clear()
    chunks = []
    dequantize_rows = int4_dequant.dequantize_rows

    def counted(packed, start, count, out, config=None):
        chunks.append((start, count))
        return dequantize_rows(packed, start, count, out, config)

    int4_dequant.dequantize_rows = counted
    codes, scales, zeros = random_int4(out_features, in_features, group_size, rows, True)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    generator = torch.Generator().manual_seed(rows + 1)
    layer = torch.nn.Module()
    layer.bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(1, rows, in_features, generator=generator).to(dtype)  # 3-D, as layers get it
    y = int4_cpu.Int4GpuLinearMethod(packed).apply(layer, x)
    int4_dequant.dequantize_rows = dequantize_rows
    reference = x[0].float() @ dequantize_reference(codes, scales, zeros, group_size).T
    if with_bias:
        reference += layer.bias.float()
    covered = sorted(chunks) == chunks and sum(count for _, count in chunks) in (0, out_features)
    return {
        "case": case,
        "chunks": len(chunks),
        "shape_ok": tuple(y.shape) == (1, rows, out_features) and y.dtype == dtype and covered,
        "error": (y[0].float() - reference).abs().max().item() / reference.abs().max().item(),
    }


def _chunk_rows() -> list[int]:
    from fitserve.kernels.int4_dequant import chunk_rows

    return [
        chunk_rows(28672, 4096, 2),
        chunk_rows(4096, 14336, 2),
        chunk_rows(6144, 4096, 2),
        chunk_rows(1000, 1 << 20, 2),  # not even CHUNK_ALIGN rows fit: the fused kernels
        chunk_rows(1000, 1024, 2, 640 * 1024 * 2 + 100),  # 2 chunks of 640 at most: 512 each is even
    ]


def _bad_outputs() -> list[str | None]:
    from fitserve.kernels.int4_dequant import dequantize_rows
    from fitserve.kernels.int4_repack import repack_int4

    codes, scales, zeros = random_int4(32, 256, 128, 0, True)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    attempts = [
        (0, 16, torch.empty(16, 256, dtype=torch.float16)),  # dtype
        (20, 16, torch.empty(16, 256, dtype=torch.bfloat16)),  # past N
        (0, 16, torch.empty(16, 255, dtype=torch.bfloat16)),  # K
        (0, 16, torch.empty(256, 16, dtype=torch.bfloat16).t()),  # column stride
    ]
    messages = []
    for start, count, out in attempts:
        try:
            dequantize_rows(packed, start, count, out)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    request = json.loads(sys.argv[1])
    if request == "chunk-rows":
        print(json.dumps(_chunk_rows()))
    elif request == "bad-outputs":
        print(json.dumps(_bad_outputs()))
    elif "dequant" in request:
        print(json.dumps([_dequant_case(case) for case in request["dequant"]]))
    else:
        print(json.dumps([_apply_case(case) for case in request["apply"]]))
