"""The C kernel sets (avx512, avx_vnni, avx2; fitserve/layers/cpu/c_kernels/library.py): which one runs for
FITSERVE_CPU_KERNELS and the CPU's flags, what is said when one cannot, and that every set this CPU has
computes the same bits as the others (vec16.h keeps their roundings and summation orders alike)."""

from __future__ import annotations

import logging

import pytest
import torch

from fitserve.layers.cpu.c_kernels import library
from fitserve.layers.cpu.c_kernels.int4_layout import pack_for_kernel
from fitserve.layers.cpu.int4_linear import INT4_TOLERANCE
from tests.unit.test_cpu_int4_linear import q4_matrix

RUNNABLE = [s.name for s in library.supported_sets() if library.load_kernel_set(s.name) is not None]
AVX2_ONLY_CPU = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
needs_two_sets = pytest.mark.skipif(len(RUNNABLE) < 2, reason="fewer than two kernel sets run on this CPU")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgets which sets loaded or failed and the remembered answer (restored afterwards)."""
    monkeypatch.setattr(library, "_answer", None)
    monkeypatch.setattr(library, "_loaded", dict(library._loaded))
    monkeypatch.setattr(library, "_failures", {})
    monkeypatch.setattr(library, "_unavailable_reason", None)


@pytest.mark.skipif(not RUNNABLE, reason="no C kernel set runs on this CPU")
@pytest.mark.usefixtures("fresh")
def test_auto_takes_the_best_set_and_a_name_forces_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(library.ENV_SWITCH, raising=False)
    best = library.load_cpu_kernels()
    assert best is not None and best.set_name == RUNNABLE[0] == library.expected_set().name
    for name in RUNNABLE:
        monkeypatch.setenv(library.ENV_SWITCH, name)
        assert library.load_cpu_kernels().set_name == name == library.expected_set().name
    monkeypatch.setenv(library.ENV_SWITCH, "torch")
    assert library.load_cpu_kernels() is None and library.expected_set() is None


@pytest.mark.usefixtures("fresh")
def test_an_unknown_value_names_the_choices(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(library.ENV_SWITCH, "avx3")
    with caplog.at_level(logging.INFO, logger="fitserve"):
        assert library.load_cpu_kernels() is None
    assert "FITSERVE_CPU_KERNELS='avx3' names no kernel set" in caplog.text
    assert "auto, one of avx512, avx_vnni, avx2, or 0" in library.unavailable_reason()
    assert library.expected_set() is None


@pytest.mark.usefixtures("fresh")
def test_an_avx2_only_cpu_gets_the_avx2_set_and_is_refused_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "cpu_flags", lambda: AVX2_ONLY_CPU)
    assert [s.name for s in library.supported_sets()] == ["avx2"]
    monkeypatch.setenv(library.ENV_SWITCH, "avx512")
    assert library.expected_set() is None
    assert library.load_cpu_kernels() is None
    reason = library.unavailable_reason()
    assert (
        "asks for the AVX-512 with VNNI kernels, but this CPU lacks avx512_vnni, avx512bw, avx512f" in reason
    )
    assert "name a set this CPU has (avx2)" in reason
    if "avx2" in RUNNABLE:  # the build itself runs on this CPU's real instructions
        monkeypatch.delenv(library.ENV_SWITCH)
        assert library.expected_set().name == "avx2"
        assert library.load_cpu_kernels().set_name == "avx2"


@pytest.mark.usefixtures("fresh")
def test_a_cpu_without_avx2_gets_none_and_says_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    monkeypatch.delenv(library.ENV_SWITCH, raising=False)
    assert library.supported_sets() == () and library.expected_set() is None
    assert library.load_cpu_kernels() is None
    assert library.unavailable_reason() == (
        "this CPU lacks avx2, f16c, fma, which the C kernels need at the least (AVX2 + FMA)"
    )


@needs_two_sets
@pytest.mark.usefixtures("fresh")
def test_auto_falls_back_to_the_next_set_when_the_best_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = library._build_and_check

    def first_fails(kernel_set: library.KernelSet) -> tuple[library.CpuKernels | None, str | None]:
        if kernel_set.name == RUNNABLE[0]:
            return None, "building for it failed (x.c:1: error: made up)"
        return real(kernel_set)

    monkeypatch.setattr(library, "_build_and_check", first_fails)
    monkeypatch.setattr(library, "_loaded", {})
    monkeypatch.delenv(library.ENV_SWITCH, raising=False)
    with caplog.at_level(logging.INFO, logger="fitserve"):
        kernels = library.load_cpu_kernels()
    assert kernels is not None and kernels.set_name == RUNNABLE[1]
    assert (
        f"the {RUNNABLE[0]} set failed here (building for it failed (x.c:1: error: made up))" in caplog.text
    )
    monkeypatch.setenv(library.ENV_SWITCH, RUNNABLE[0])  # forced: no fallback, the reason said
    assert library.load_cpu_kernels() is None
    assert library.unavailable_reason() == "building for it failed (x.c:1: error: made up)"


def all_sets() -> list[library.CpuKernels]:
    return [library.load_kernel_set(name) for name in RUNNABLE]


@needs_two_sets
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_every_set_gives_the_int4_gemm_the_same_bits(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 16, (48, 128), generator=gen, dtype=torch.int32)
    step = (torch.rand(48, 4, generator=gen) * 0.01 + 1e-3).half()
    minimum = (-8 * step.float() + torch.randn(48, 4, generator=gen) * 1e-3).half()
    packed, scales = pack_for_kernel(codes, step, minimum)
    x = torch.randn(rows, 128, generator=gen) * 4
    x[0, 3] = 300.0  # an outlier: its group's second int8 level carries the rest
    bias = torch.randn(48, generator=gen)
    outputs = [kernels.int4_gemm(x, packed, scales, 48, bias) for kernels in all_sets()]
    for name, out in zip(RUNNABLE[1:], outputs[1:], strict=True):
        assert torch.equal(out, outputs[0]), f"{name} differs from {RUNNABLE[0]}"


@needs_two_sets
def test_every_set_gives_the_elementwise_kernels_and_the_packer_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual, weight = (torch.randn(5, 576, generator=gen) for _ in range(3))
    gate_up = torch.cat([torch.linspace(-120, 100, 2 * 3072).view(2, -1), torch.randn(3, 3072) * 8])
    heads, cos, sin = torch.randn(3, 9, 64), torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    weight_q4 = q4_matrix(64, 256, seed=2)
    results = []
    for kernels in all_sets():
        normed, summed = kernels.elementwise.add_rms_norm_(x.clone(), residual.clone(), weight, 1e-5)
        packed = kernels.int4_pack(weight_q4, INT4_TOLERANCE)
        results.append(
            [
                normed,
                summed,
                kernels.elementwise.rms_norm(x, weight, 1e-6),
                kernels.elementwise.silu_and_mul(gate_up),
                kernels.elementwise.rotary_(heads.clone(), cos, sin),
                packed.codes,
                packed.scales,
                torch.tensor(packed.max_deviation),
            ]
        )
    for name, result in zip(RUNNABLE[1:], results[1:], strict=True):
        for got, want in zip(result, results[0], strict=True):
            assert torch.equal(got, want), f"{name} differs from {RUNNABLE[0]}"


@needs_two_sets
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 32)])
def test_every_set_gives_decode_attention_the_same_bits(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    block_size = 16
    cache = torch.randn(2, 8, block_size, num_kv_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([45, 3], dtype=torch.int32)
    tables = torch.tensor([[6, 1, 3], [5, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([3 * block_size + 12, 5 * block_size + 2])
    q = torch.randn(2, num_heads, head_dim, generator=gen)
    k, v = (torch.randn(2, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    outputs = []
    for kernels in all_sets():
        layer_cache = cache.clone()
        outputs.append(kernels.decode_attention(q, k, v, layer_cache, slots, tables, seq_lens, 0.125))
        assert torch.equal(layer_cache[0].view(-1, num_kv_heads, head_dim)[slots[1]], k[1])
    for name, out in zip(RUNNABLE[1:], outputs[1:], strict=True):
        assert torch.equal(out, outputs[0]), f"{name} differs from {RUNNABLE[0]}"


@pytest.mark.skipif("avx2" not in RUNNABLE, reason="the avx2 kernels do not run on this CPU")
@pytest.mark.usefixtures("fresh")
def test_doctor_names_the_set_that_runs_and_what_a_better_one_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from fitserve.cli import doctor

    monkeypatch.setenv(library.ENV_SWITCH, "avx2")
    check = doctor.cpu_kernels_check()
    assert check.status == "PASS"
    assert "kernel set avx2 (AVX2 + FMA; forced by FITSERVE_CPU_KERNELS=avx2)" in check.detail
    monkeypatch.setattr(library, "cpu_flags", lambda: AVX2_ONLY_CPU)
    monkeypatch.delenv(library.ENV_SWITCH)
    check = doctor.cpu_kernels_check()
    assert (
        "kernel set avx2 (AVX2 + FMA; the best this CPU has; avx512 would need avx512_vnni, avx512bw, "
        in (check.detail)
    )
    monkeypatch.setenv(library.ENV_SWITCH, "avx512")
    check = doctor.cpu_kernels_check()
    assert check.status == "WARN" and "this CPU lacks avx512_vnni" in check.detail
    assert check.fix == "unset FITSERVE_CPU_KERNELS, or set it to a kernel set this CPU has"
