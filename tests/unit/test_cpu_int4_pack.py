"""The C packer (int4_pack.c) against torch's find_int4_groups + pack_for_kernel: the same bytes, the same
matrices refused, for each kernel set this CPU has."""

from __future__ import annotations

import pytest
import torch

from fitserve.layers.cpu.c_kernels import library
from fitserve.layers.cpu.c_kernels.int4_layout import pack_for_kernel
from fitserve.layers.cpu.int4_linear import INT4_TOLERANCE, find_int4_groups
from tests.unit.cpu_kernel_sets import KERNEL_SET_NAMES, use_kernel_set
from tests.unit.test_cpu_int4_linear import q4_matrix


@pytest.fixture(autouse=True, params=KERNEL_SET_NAMES)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> library.CpuKernels:
    return use_kernel_set(request.param, monkeypatch)


def torch_packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    groups = find_int4_groups(weight, stored_as="kernel")
    if groups is None:
        return None
    codes, scales = pack_for_kernel(groups.codes, groups.step.half(), groups.low.half())
    return codes, scales, groups.max_deviation


def assert_same_as_torch(kernels: library.CpuKernels, weight: torch.Tensor) -> None:
    expected = torch_packed(weight)
    packed = kernels.int4_pack(weight, INT4_TOLERANCE)
    assert (packed is None) == (expected is None)
    if expected is not None:
        codes, scales, deviation = expected
        assert torch.equal(packed.codes, codes)
        assert torch.equal(packed.scales, scales)
        assert packed.max_deviation == pytest.approx(deviation, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize(("rows", "cols", "seed"), [(16, 32, 0), (64, 576, 1), (1536, 576, 2), (48, 1536, 3)])
def test_q4_matrices_pack_to_the_same_bytes(
    kernels: library.CpuKernels, rows: int, cols: int, seed: int
) -> None:
    assert_same_as_torch(kernels, q4_matrix(rows, cols, seed))


def test_constant_groups_and_two_valued_groups(kernels: library.CpuKernels) -> None:
    weight = q4_matrix(32, 64, seed=4)
    weight[0, :32] = 0.25  # one value: step 0, every code 0
    weight[1, 32:] = torch.arange(32) % 16 * 0.5 - 2.0  # every code once per half group, step 0.5
    weight[2, :32] = torch.tensor([0.0, 7.5] * 16)  # only codes 0 and 15
    assert_same_as_torch(kernels, weight)


def test_a_tie_between_two_codes_rounds_as_torch_does_and_is_refused_by_both(
    kernels: library.CpuKernels,
) -> None:
    weight = q4_matrix(32, 64, seed=7)
    weight[3, :32] = torch.tensor([0.0, 15.0] + [2.5] * 30)  # step 1: (2.5 - 0) / 1 is a tie
    assert_same_as_torch(kernels, weight)


def test_bf16_rounded_q4_weights_as_loaded_from_a_conversion(kernels: library.CpuKernels) -> None:
    """A converted GGUF stores its dequantized weights as bfloat16; the engine loads them as float32."""
    assert_same_as_torch(kernels, q4_matrix(64, 256, seed=5).bfloat16().float())


@pytest.mark.parametrize("spoil", [False, True])
def test_a_bf16_weight_packs_as_its_float32_values_do(kernels: library.CpuKernels, spoil: bool) -> None:
    stored = q4_matrix(64, 256, seed=8).bfloat16()
    if spoil:
        stored[3, 9] = 0.123  # off its group's grid: refused from either dtype
    from_bf16 = kernels.int4_pack(stored, INT4_TOLERANCE)
    from_float32 = kernels.int4_pack(stored.float(), INT4_TOLERANCE)
    assert (from_bf16 is None) == (from_float32 is None) == spoil
    if not spoil:
        assert torch.equal(from_bf16.codes, from_float32.codes)
        assert torch.equal(from_bf16.scales, from_float32.scales)
        assert from_bf16.max_deviation == from_float32.max_deviation


@pytest.mark.parametrize("spoil", ["random", "nan", "inf", "one_value_off"])
def test_matrices_that_are_not_4_bit_groups_are_refused(kernels: library.CpuKernels, spoil: str) -> None:
    weight = q4_matrix(32, 64, seed=6)
    if spoil == "random":
        weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    elif spoil == "nan":
        weight[5, 7] = float("nan")
    elif spoil == "inf":
        weight[5, 7] = float("inf")
    else:
        weight[5, 7] += 0.3 * (weight[5, :32].max() - weight[5, :32].min()) / 15
    assert kernels.int4_pack(weight, INT4_TOLERANCE) is None
    assert torch_packed(weight) is None


def test_shapes_outside_the_layout_are_not_packed(kernels: library.CpuKernels) -> None:
    assert kernels.int4_pack(q4_matrix(24, 64), INT4_TOLERANCE) is None  # rows not a multiple of 16
    assert kernels.int4_pack(q4_matrix(32, 64)[:, :48], INT4_TOLERANCE) is None  # 48 columns
    assert kernels.int4_pack(q4_matrix(32, 64).double(), INT4_TOLERANCE) is None  # not float32
