"""kernels/fp8_w8a16.py compiled here for sm_80 and sm_90 (no GPU: Triton's bundled ptxas), which also
checks fp8_bits.e4m3_bytes_to_bfloat16's inline PTX. Beside bfloat16 activations the kernel takes the
weight's bytes (fp8_bits.e4m3_as_stored) and decodes them in integer instructions and one bfloat16
multiply a pair: its loop must hold no instruction of the conversion unit (F2F, F2FP), which runs at a
quarter of the integer rate and bounded Triton's e4m3 -> float16 -> bfloat16 (docs/quantization.md)."""

from __future__ import annotations

import collections

import pytest

triton = pytest.importorskip("triton")

from fitserve.kernels import fp8_w8a16  # noqa: E402
from tests.unit.sass_helpers import main_loop, triton_sass_of  # noqa: E402

POINTERS = ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "counter_ptr")
INTS = ("M", "N", "K", "stride_x", "stride_w", "stride_s", "stride_y", "steps_per_split", "num_splits")
CONVERSIONS = ("F2F", "F2FP", "I2F", "F2I")


def _loop_opcodes(arch: int, as_bytes: bool, grouped: bool) -> collections.Counter:
    """Opcode counts of the kernel's K loop (sass_helpers.main_loop), the weight given as bytes or as e4m3."""
    types = {"x_ptr": "*bf16", "w_ptr": "*u8" if as_bytes else "*fp8e4nv", "s_ptr": "*fp32"}
    types |= {"y_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32"}
    signature = types | {name: "i32" for name in INTS}
    constexprs = {"GROUPED": grouped, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128 if grouped else 256}
    constexprs["SPLIT"] = True
    aligned = [*POINTERS, "K", "stride_x", "stride_w", "stride_y"]
    return main_loop(triton_sass_of(fp8_w8a16._w8a16_kernel, arch, signature, constexprs, aligned))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("grouped", [False, True])
def test_decoding_bytes_leaves_the_conversion_unit_out_of_the_loop(arch: int, grouped: bool) -> None:
    loop = _loop_opcodes(arch, as_bytes=True, grouped=grouped)
    assert not {op: loop[op] for op in CONVERSIONS if loop[op]}, dict(loop)
    # one bfloat16 multiply (HMUL2 / HFMA2) a weight pair: BLOCK_N x BLOCK_K weights over 4 warps
    weights_per_thread = 32 * (128 if grouped else 256) // 128
    assert loop["HMUL2"] + loop["HFMA2"] == weights_per_thread // 2, dict(loop)


def test_tritons_conversion_runs_on_the_conversion_unit() -> None:  # why the bytes (sm_90)
    loop = _loop_opcodes(90, as_bytes=False, grouped=False)
    assert loop["F2F"] + loop["F2FP"] >= 32 * 256 // 128, dict(loop)
