"""kernels/fused_moe_fp8.py's W8A8 kernels compiled here for sm_90 (no GPU: Triton's bundled ptxas): with
tiles of 16 or 32 token rows, the plain form's fp8 x fp8 products lower to float16 mma.sync (HMMA, every
weight converted on the way), so on Hopper the kernels take the weight tile as the MMA's rows
(`swaps_operands`). The swapped form must reach the fp8 warpgroup MMA (QGMMA on e4m3) and no HMMA; the
plain form is read too, as the reason the swap exists."""

from __future__ import annotations

import collections
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from fitserve.kernels import fused_moe_fp8  # noqa: E402
from fitserve.kernels.capability import forced_target  # noqa: E402
from tests.unit.sass_helpers import triton_sass_of  # noqa: E402

GATE_UP_POINTERS = {
    "x_ptr": "*fp8e4nv",
    "x_scale_ptr": "*fp32",
    "w_ptr": "*fp8e4nv",
    "s_ptr": "*fp32",
    "mid_ptr": "*fp8e4nv",
    "mid_scale_ptr": "*fp32",
    "sorted_pairs_ptr": "*i32",
    "block_expert_ptr": "*i32",
    "num_blocks_ptr": "*i32",
}
GATE_UP_INTS = ("num_pairs", "top_k", "hidden", "intermediate", "stride_xm", "stride_xsm", "stride_xsg")
DOWN_POINTERS = {
    "mid_ptr": "*fp8e4nv",
    "mid_scale_ptr": "*fp32",
    "w_ptr": "*fp8e4nv",
    "s_ptr": "*fp32",
    "topk_weights_ptr": "*fp32",
    "per_pair_ptr": "*bf16",
    "sorted_pairs_ptr": "*i32",
    "block_expert_ptr": "*i32",
    "num_blocks_ptr": "*i32",
}
DOWN_INTS = ("num_pairs", "hidden", "intermediate", "stride_mm", "stride_msm")
WEIGHT_INTS = ("stride_we", "stride_wn", "stride_se", "stride_sn")


def _mma_opcodes(kernel: str, swap: bool, block_m: int) -> collections.Counter:
    """Counts of the MMA opcodes (with their shapes and types) in the sm_90 SASS of `kernel` (gate_up or
    down) as fused_moe_fp8 launches it for Qwen3-30B-A3B-FP8 (128-column weight blocks, W8A8)."""
    constexprs = {
        "GROUP_K": 128,
        "PER_ROW": False,
        "A_FP8": True,
        "A_GROUP": fused_moe_fp8.A_GROUP,
        "SWAP_AB": swap,
        "BLOCK_M": block_m,
        "BLOCK_N": 128,
        "BLOCK_K": 128,
        "NUM_STAGES": 3,
        "USE_PDL": True,
    }
    if kernel == "gate_up":
        function = fused_moe_fp8._moe_fp8_gate_up_kernel
        pointers, ints = GATE_UP_POINTERS, (*GATE_UP_INTS, *WEIGHT_INTS, "stride_mm", "stride_msm")
        constexprs |= {"ACTIVATION": 0, "EXACT_BITS": False}
    else:
        function = fused_moe_fp8._moe_fp8_down_kernel
        pointers, ints = DOWN_POINTERS, (*DOWN_INTS, *WEIGHT_INTS, "stride_pm")
    signature = dict(pointers) | {name: "i32" for name in ints}
    aligned = [*pointers, "hidden", "intermediate", "stride_we", "stride_wn", "stride_mm"]
    sass = triton_sass_of(function, 90, signature, constexprs, aligned)
    return collections.Counter(re.findall(r"\b((?:QGMMA|HGMMA|HMMA)\.[\w.]+)", sass))


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_swapped_tiles_reach_the_fp8_warpgroup_mma(kernel: str, block_m: int) -> None:
    swapped = _mma_opcodes(kernel, swap=True, block_m=block_m)
    assert swapped, "no MMA instruction in the swapped kernel's SASS"
    assert all(op.startswith("QGMMA.64x") and op.endswith("E4M3.E4M3") for op in swapped), dict(swapped)
    plain = _mma_opcodes(kernel, swap=False, block_m=block_m)
    assert any(op.startswith("HMMA.16816") for op in plain), dict(plain)  # why the swap exists


@pytest.mark.parametrize(
    ("w8a8", "block_m", "capability", "swaps"),
    [
        (True, 16, (9, 0), True),
        (True, 32, (10, 0), True),
        (True, 64, (9, 0), False),  # 64 rows reach the warpgroup MMA as they are
        (True, 16, (8, 9), False),  # Ada's fp8 mma.sync takes 16 rows either way
        (False, 16, (9, 0), False),  # W8A16 multiplies in 16-bit
    ],
)
def test_which_tiles_swap(w8a8: bool, block_m: int, capability: tuple[int, int], swaps: bool) -> None:
    with forced_target(capability):
        assert fused_moe_fp8.swaps_operands(w8a8, block_m, torch.device("cpu")) is swaps
    assert not fused_moe_fp8.swaps_operands(w8a8, block_m, torch.device("cpu"))  # not a CUDA device


@pytest.mark.parametrize(
    ("tokens", "capability", "block_m"),
    [
        (64, (9, 0), 16),  # 4 pairs an expert (top 8 of 128)
        (256, (9, 0), 32),  # 16: swapped 32-row tiles from 12 pairs an expert on
        (2048, (9, 0), 32),  # 128
        (256, (8, 9), 16),  # Ada: not swapped, 16 rows below 24 pairs an expert
        (1024, (8, 9), 32),
        (2048, (8, 9), 64),
    ],
)
def test_tile_rows_by_pairs_an_expert(tokens: int, capability: tuple[int, int], block_m: int) -> None:
    with forced_target(capability):
        assert fused_moe_fp8.w8a8_block_m(tokens * 8, 128, torch.device("cpu")) == block_m
