"""fitserve's C int4 GEMM (fitserve/layers/cpu/c_kernels/int4_gemm.c): its layout, its accuracy against the
dequantized weights for every row count, the linear layers that use it (once per kernel set this CPU has),
and how it is built or refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.cpu.c_kernels import library
from fitserve.layers.cpu.c_kernels.int4_layout import pack_for_kernel, unpack_from_kernel
from fitserve.layers.cpu.int4_kernel_linear import Int4KernelCpuLinearMethod
from fitserve.layers.cpu.int4_linear import Int4CpuLinearMethod, kernel_available
from fitserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tests.unit.cpu_kernel_sets import KERNEL_SET_NAMES, use_kernel_set
from tests.unit.test_cpu_int4_linear import q4_matrix, q4_qkv_layer_with_bias

needs_kernels = pytest.mark.skipif(library.expected_set() is None, reason="no C kernel set for this machine")


@pytest.fixture(params=KERNEL_SET_NAMES)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> library.CpuKernels:
    return use_kernel_set(request.param, monkeypatch)


def random_groups(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int32)
    step = (torch.rand(rows, cols // 32, generator=gen) * 0.01 + 1e-3).half()
    minimum = (-8 * step.float() + torch.randn(rows, cols // 32, generator=gen) * 1e-3).half()
    return codes, step, minimum


def dense(codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    grouped = codes.view(rows, -1, 32).double() * step.double()[..., None] + minimum.double()[..., None]
    return grouped.view(rows, cols)


def test_layout_round_trips_and_pins_the_byte_order() -> None:
    codes, step, minimum = random_groups(32, 64)
    packed, scales = pack_for_kernel(codes, step, minimum)
    assert packed.shape == (2, 8, 64) and packed.dtype == torch.uint8
    assert scales.shape == (2, 2, 2, 16) and scales.dtype == torch.float16
    assert torch.equal(unpack_from_kernel(packed, scales).double(), dense(codes, step, minimum))
    # byte 4 j + i of block 0, chunk 0: column j's k = i (low nibble) and k = 4 + i (high nibble)
    assert int(packed[0, 0, 4 * 3 + 1]) == int(codes[3, 1]) | int(codes[3, 5]) << 4
    assert scales[1, 1, 0, 2] == step[16 + 2, 1] and scales[1, 1, 1, 2] == minimum[16 + 2, 1]


def test_layout_refuses_shapes_it_cannot_hold() -> None:
    codes, step, minimum = random_groups(24, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_for_kernel(codes, step, minimum)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_the_dequantized_product(kernels: library.CpuKernels, rows: int, with_bias: bool) -> None:
    codes, step, minimum = random_groups(48, 96, seed=rows)
    packed, scales = pack_for_kernel(codes, step, minimum)
    gen = torch.Generator().manual_seed(100 + rows)
    wide = torch.randn(rows, 160, generator=gen)
    x = wide[:, 32:128]  # rows 160 apart in memory: the kernel reads rows through their stride
    bias = torch.randn(48, generator=gen) if with_bias else None
    got = kernels.int4_gemm(x, packed, scales, 48, bias)
    want = x.double() @ dense(codes, step, minimum).T + (0 if bias is None else bias.double())
    # two int8 levels per activation: within ~1.6e-5 of each group's largest |x|
    assert float((got.double() - want).norm() / want.norm()) < 1e-4


def test_gemm_keeps_precision_next_to_an_outlier(kernels: library.CpuKernels) -> None:
    """An activation 1000x the others scales its whole group; the second int8 level keeps the rest."""
    codes, step, minimum = random_groups(32, 64, seed=3)
    packed, scales = pack_for_kernel(codes, step, minimum)
    x = torch.randn(2, 64)
    x[0, 5] = 1000.0
    weight = dense(codes, step, minimum)
    got = kernels.int4_gemm(x, packed, scales, 32).double()
    want = x.double() @ weight.T
    group_max = x.abs().view(2, 2, 32).amax(-1).double()  # [row, group]
    bound = (weight.abs().view(32, 2, 32).sum(-1) @ (group_max / (127 * 508)).T).T + 1e-4
    assert bool(((got - want).abs() <= bound).all())


@pytest.mark.usefixtures("kernels")
def test_q4_layers_pack_for_the_kernel_and_match_their_loaded_weights() -> None:
    gate, up = q4_matrix(64, 64, seed=2), q4_matrix(128, 64, seed=3)
    merged = MergedColumnParallelLinear(64, [64, 128], bias=False)
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    assert isinstance(merged.linear_method, Int4KernelCpuLinearMethod)
    assert merged.weight.dtype == torch.uint8 and not hasattr(merged, "fp16_weight")
    loaded = torch.cat([gate, up])
    held = unpack_from_kernel(merged.weight, merged.int4_scales)
    torch.testing.assert_close(held, loaded, atol=2**-10 * loaded.abs().max().item(), rtol=0)
    for rows in (1, 9, 200):
        x = torch.randn(rows, 64)
        with torch.inference_mode():
            got = merged(x)
        assert got.shape == (rows, 192) and got.dtype == torch.float32
        want = F.linear(x.double(), held.double())
        assert float((got.double() - want).norm() / want.norm()) < 1e-4
    with pytest.raises(ValueError, match="already loaded and repacked"):
        merged.weight_loader(merged.weight, gate, 0)


@pytest.mark.usefixtures("kernels")
def test_qkv_layer_bias_and_three_dimensional_input() -> None:
    layer, _, bias = q4_qkv_layer_with_bias()
    assert isinstance(layer.linear_method, Int4KernelCpuLinearMethod)
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():
        got = layer(x)
    want = F.linear(x, unpack_from_kernel(layer.weight, layer.int4_scales), bias)
    assert got.shape == (2, 3, 128)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


@pytest.mark.skipif(not kernel_available(), reason="no torch CPU int4 kernel")
def test_switch_off_uses_torch_int4_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(library.ENV_SWITCH, "0")
    assert library.load_cpu_kernels() is None
    layer = RowParallelLinear(64, 64, bias=False)
    layer.weight_loader(layer.weight, q4_matrix(64, 64, seed=8))
    assert isinstance(layer.linear_method, Int4CpuLinearMethod)


def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, compiler: str) -> object:
    monkeypatch.setattr(library, "_loaded", {})
    monkeypatch.setattr(library, "_failures", {})
    monkeypatch.setattr(library, "_answer", None)
    monkeypatch.delenv(library.ENV_SWITCH, raising=False)
    monkeypatch.setenv("FITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", compiler)
    return library.load_cpu_kernels()


def test_no_compiler_means_no_kernels_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fitserve"):
        assert fresh_build(monkeypatch, tmp_path, str(tmp_path / "no-such-cc")) is None
    assert "no C compiler found" in caplog.text and "torch's operations run instead" in caplog.text


def test_failed_build_means_no_kernels_and_names_the_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing = tmp_path / "failing-cc"
    failing.write_text('#!/bin/sh\necho "x.c:1:2: error: this CPU lacks AVX-512" >&2\nexit 1\n')
    failing.chmod(0o755)
    with caplog.at_level(logging.INFO, logger="fitserve"):
        assert fresh_build(monkeypatch, tmp_path, str(failing)) is None
    assert "failed (x.c:1:2: error: this CPU lacks AVX-512)" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left in the cache


@needs_kernels
def test_build_is_cached_per_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    first = fresh_build(monkeypatch, tmp_path, "cc")
    assert first is not None and first.path.is_file()
    built_at = first.path.stat().st_mtime_ns
    second = fresh_build(monkeypatch, tmp_path, "cc")
    assert second is not None and second.path == first.path and second.path.stat().st_mtime_ns == built_at
