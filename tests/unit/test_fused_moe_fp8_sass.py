"""kernels/fused_moe_fp8.py's W8A8 kernels compiled here for sm_90 (no GPU: Triton's bundled ptxas): with
tiles of 16 or 32 token rows, the plain form's fp8 x fp8 products lower to float16 mma.sync (HMMA, every
weight converted on the way), so on Hopper the kernels take the weight tile as the MMA's rows
(`swaps_operands`). The swapped form must reach the fp8 warpgroup MMA (QGMMA on e4m3) and no HMMA; the
plain form is read too, as the reason the swap exists. With the weights as a TMA descriptor the copy
engine streams them (UTMALDG)."""

from __future__ import annotations

import collections
import gc
import re
import weakref

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


def _sass(kernel: str, swap: bool, block_m: int, weight_descriptor: bool = False) -> str:
    """The sm_90 SASS of `kernel` (gate_up or down) as fused_moe_fp8 launches it for Qwen3-30B-A3B-FP8
    (128-column weight blocks, W8A8); weight_descriptor: the weights as a TMA descriptor (W_DESC)."""
    constexprs = {
        "GROUP_K": 128,
        "PER_ROW": False,
        "A_FP8": True,
        "A_GROUP": fused_moe_fp8.A_GROUP,
        "SWAP_AB": swap,
        "W_DESC": weight_descriptor,
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
    aligned = [*pointers, "hidden", "intermediate", "stride_we", "stride_wn", "stride_mm"]
    if weight_descriptor:
        pointers = pointers | {"w_ptr": "tensordesc<fp8e4nv[128, 128]>"}
        aligned.remove("w_ptr")
    signature = dict(pointers) | {name: "i32" for name in ints}
    return triton_sass_of(function, 90, signature, constexprs, aligned)


def _mma_opcodes(kernel: str, swap: bool, block_m: int) -> collections.Counter:
    """Counts of the MMA opcodes (with their shapes and types) in `_sass`."""
    sass = _sass(kernel, swap, block_m)
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


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_swapped_tiles_stream_the_weights_by_tma(kernel: str) -> None:
    """With the weights as a descriptor (Hopper, `loads_weights_by_tma`) the copy engine brings each weight
    tile (UTMALDG), the MMAs stay fp8 warpgroup ones, and cp.async carries only the activations: fewer
    LDGSTS than the pointer form, whose weight tiles take most of them."""
    by_tma = _sass(kernel, swap=True, block_m=32, weight_descriptor=True)
    by_pointers = _sass(kernel, swap=True, block_m=32)
    assert "UTMALDG" in by_tma and "UTMALDG" not in by_pointers
    mmas = re.findall(r"\b((?:QGMMA|HGMMA|HMMA)\.[\w.]+)", by_tma)
    assert mmas and all(op.startswith("QGMMA.64x") and op.endswith("E4M3.E4M3") for op in mmas)
    assert by_tma.count("LDGSTS") < by_pointers.count("LDGSTS") / 2


def test_which_weights_go_by_tma(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_moe_fp8, "INTERPRETING", False)  # the rule as a GPU process sees it
    weights = torch.zeros(4, 256, 512, dtype=fused_moe_fp8.FP8)
    assert fused_moe_fp8.loads_weights_by_tma(weights, swap=True)
    assert not fused_moe_fp8.loads_weights_by_tma(weights, swap=False)  # below Hopper, or 64-row tiles
    assert not fused_moe_fp8.loads_weights_by_tma(weights.view(torch.uint8), swap=True)  # W8A16's bytes
    assert not fused_moe_fp8.loads_weights_by_tma(weights[:, :, :500], swap=True)  # not contiguous
    odd_rows = torch.zeros(4, 256, 520, dtype=fused_moe_fp8.FP8)[:, :, :8].contiguous()
    assert not fused_moe_fp8.loads_weights_by_tma(odd_rows, swap=True)  # 8-byte rows: TMA needs 16
    monkeypatch.setattr(fused_moe_fp8, "TMA_WEIGHTS", False)
    assert not fused_moe_fp8.loads_weights_by_tma(weights, swap=True)
    monkeypatch.setattr(fused_moe_fp8, "TMA_WEIGHTS", True)
    monkeypatch.setattr(fused_moe_fp8, "INTERPRETING", True)
    assert not fused_moe_fp8.loads_weights_by_tma(weights, swap=True)


def test_a_descriptor_views_the_experts_as_rows_and_is_kept() -> None:
    weights = torch.zeros(4, 256, 512, dtype=fused_moe_fp8.FP8)
    descriptor = fused_moe_fp8.weight_descriptor(weights, 128, 128)
    assert list(descriptor.shape) == [4 * 256, 512] and list(descriptor.block_shape) == [128, 128]
    assert descriptor.base.data_ptr() == weights.data_ptr()
    assert fused_moe_fp8.weight_descriptor(weights, 128, 128) is descriptor
    assert fused_moe_fp8.weight_descriptor(weights, 64, 128) is not descriptor


def test_descriptors_go_with_their_weights() -> None:
    """A kept descriptor holds a view of its weights: it must not outlive the tensor the layer drops (an
    engine's experts would stay in GPU memory after the engine is gone)."""
    weights = torch.zeros(4, 256, 512, dtype=fused_moe_fp8.FP8)
    storage = weakref.ref(weights.untyped_storage())
    fused_moe_fp8.weight_descriptor(weights, 128, 128)
    del weights
    gc.collect()
    assert storage() is None


def test_weights_given_new_storage_get_a_new_descriptor() -> None:
    """A tensor whose storage is replaced (param.data = ...) gets a descriptor over the new storage, and the
    old descriptors, which held the old storage, go."""
    weights = torch.zeros(4, 256, 512, dtype=fused_moe_fp8.FP8)
    old_storage = weakref.ref(weights.untyped_storage())
    first = fused_moe_fp8.weight_descriptor(weights, 128, 128)
    weights.data = torch.ones(4, 256, 512, dtype=fused_moe_fp8.FP8)
    second = fused_moe_fp8.weight_descriptor(weights, 128, 128)
    assert second is not first and second.base.data_ptr() == weights.data_ptr()
    del first
    gc.collect()
    assert old_storage() is None
