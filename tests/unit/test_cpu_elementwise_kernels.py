"""fitserve's C RMSNorm and rotary kernels (fitserve/layers/cpu/c_kernels/elementwise.c) against the torch
formulas they replace, and the layers that take them: each test once per kernel set this CPU has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.activation import SiluAndMul
from fitserve.layers.cpu.c_kernels import library
from fitserve.layers.cpu.c_kernels.elementwise import Elementwise
from fitserve.layers.layernorm import RMSNorm
from fitserve.layers.rotary_embedding import RopeSettings, RotaryEmbedding
from tests.unit.cpu_kernel_sets import KERNEL_SET_NAMES, use_kernel_set


@pytest.fixture(autouse=True, params=KERNEL_SET_NAMES)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> library.CpuKernels:
    return use_kernel_set(request.param, monkeypatch)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_rms_norm_layer_with_and_without_residual(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x = torch.randn(rows, 576, generator=gen)
    residual = torch.randn(rows, 576, generator=gen)
    assert Elementwise.rms_norm_supports(x, residual, norm.weight)
    alone = norm(x)
    torch.testing.assert_close(alone, hf_rms_norm(x, norm.weight, 1e-5), rtol=2e-6, atol=1e-6)
    assert alone.data_ptr() != x.data_ptr()  # x stays: it becomes the residual stream
    want_summed, x_ptr, residual_ptr = x + residual, x.data_ptr(), residual.data_ptr()
    want_normed = hf_rms_norm(want_summed, norm.weight, 1e-5)
    normed, summed = norm(x, residual)
    assert torch.equal(summed, want_summed)  # the residual stream is the exact float32 sum
    torch.testing.assert_close(normed, want_normed, rtol=2e-6, atol=1e-6)
    assert (normed.data_ptr(), summed.data_ptr()) == (x_ptr, residual_ptr)  # in place, as on CUDA


def test_rms_norm_of_strided_rows_takes_the_torch_path() -> None:
    norm = RMSNorm(64)
    wide = torch.randn(3, 80)
    x, residual = wide[:, :64], torch.randn(3, 64)
    assert not Elementwise.rms_norm_supports(x, residual, norm.weight)
    normed, summed = norm(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(x, wide[:, :64])


@pytest.mark.parametrize("rows", [1, 7])
def test_silu_and_mul_matches_torch(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 3100, generator=gen) * 6
    wide[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    x = wide[:, :3072]  # rows read through their stride
    got = SiluAndMul()(x)
    want = F.silu(x[:, :1536]) * x[:, 1536:]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    narrow = torch.randn(2, 48, generator=gen)  # halves of 24: not the kernel's, the torch path
    assert not Elementwise.silu_and_mul_supports(narrow)
    assert torch.equal(SiluAndMul()(narrow), F.silu(narrow[:, :24]) * narrow[:, 24:])


def test_rms_norm_declines_other_layouts() -> None:
    weight = torch.ones(64)
    assert not Elementwise.rms_norm_supports(torch.randn(2, 3, 64), None, weight)  # per-head q/k norms
    assert not Elementwise.rms_norm_supports(torch.randn(2, 64).bfloat16(), None, weight)
    assert not Elementwise.rms_norm_supports(torch.randn(2, 40), None, torch.ones(40))
    assert not Elementwise.rms_norm_supports(torch.randn(64, 2).t(), None, weight)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_equals_rotate_bit_for_bit(head_dim: int) -> None:
    rotary = RotaryEmbedding(head_dim, RopeSettings(theta=10000.0), 4096)
    rope = rotary.rope_for_step(torch.tensor([0, 7, 4095]), torch.float32)
    qkv = torch.randn(3, 12 * head_dim)
    qk = qkv[:, : 9 * head_dim].view(3, 9, head_dim)  # 9 q + k heads; v after them
    want = rope.rotate(qk)
    v_before = qkv[:, 9 * head_dim :].clone()
    got = rope.rotate_(qk)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, want)
    assert torch.equal(qkv[:, 9 * head_dim :], v_before)


def test_rotary_falls_back_to_a_new_tensor() -> None:
    rotary = RotaryEmbedding(16, RopeSettings(theta=10000.0), 64)  # 16 dims: not the kernel's
    rope = rotary.rope_for_step(torch.tensor([3]), torch.float32)
    x = torch.randn(1, 2, 16)
    got = rope.rotate_(x)
    assert got.data_ptr() != x.data_ptr() and torch.equal(got, rope.rotate(x))
