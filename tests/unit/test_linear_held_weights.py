"""A bfloat16 checkpoint's matrices for float32 CPU linears are held as loaded and packed as int4 from
them (linear.LinearBase._holds); a matrix that is not 4-bit groups is copied into the float32 weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.cpu.int4_kernel_linear import Int4KernelCpuLinearMethod
from fitserve.layers.cpu.int4_linear import Int4CpuLinearMethod
from fitserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear, UnquantizedLinearMethod
from tests.unit.test_cpu_int4_linear import q4_matrix

INT4_METHODS = (Int4KernelCpuLinearMethod, Int4CpuLinearMethod)


def merged_layer(gate: torch.Tensor, up: torch.Tensor) -> MergedColumnParallelLinear:
    layer = MergedColumnParallelLinear(64, [64, 128], bias=False)
    layer.weight_loader(layer.weight, gate, 0)
    assert layer.weight.dtype == torch.float32  # not whole yet: nothing packed or copied
    layer.weight_loader(layer.weight, up, 1)
    return layer


def test_bf16_q4_shards_pack_as_their_float32_values_do() -> None:
    gate, up = q4_matrix(64, 64, seed=2).bfloat16(), q4_matrix(128, 64, seed=3).bfloat16()
    from_bf16 = merged_layer(gate, up)
    from_float32 = merged_layer(gate.float(), up.float())
    assert isinstance(from_bf16.linear_method, INT4_METHODS)
    assert type(from_bf16.linear_method) is type(from_float32.linear_method)
    assert torch.equal(from_bf16.weight, from_float32.weight) and from_bf16._held == {}
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert torch.equal(from_bf16(x), from_float32(x))


def test_a_bf16_matrix_that_is_not_4_bit_groups_is_copied_in_as_float32() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=generator).bfloat16()
    layer = RowParallelLinear(64, 128, bias=False)
    layer.weight_loader(layer.weight, weight)
    assert isinstance(layer.linear_method, UnquantizedLinearMethod) and layer._held == {}
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, weight.float())
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.float()))


def test_a_held_shard_of_the_wrong_shape_is_refused_as_a_copied_one_is() -> None:
    layer = MergedColumnParallelLinear(64, [64, 128], bias=False)
    message = r"checkpoint tensor has shape \(32, 64\) but the parameter expects \(64, 64\)"
    with pytest.raises(ValueError, match=message):
        layer.weight_loader(layer.weight, torch.zeros(32, 64, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match=message):
        layer.weight_loader(layer.weight, torch.zeros(32, 64), 0)
