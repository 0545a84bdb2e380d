"""fast_launch: the cached launch path gives JITFunction.run's results and compiles a new variant
whenever an argument changes in a way Triton specializes on."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fitserve.kernels.fast_launch import fast_launch, launch_hooks_installed, specialization_key  # noqa: E402
from fitserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from fitserve.kernels.reference import rms_norm_reference  # noqa: E402

pytestmark = pytest.mark.gpu


@fast_launch
@triton.jit
def _scaled_copy_kernel(src, dst, n, stride, scale, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src + offsets * stride, mask=mask)
    tl.store(dst + offsets, values * scale + SHIFT, mask=mask)


def _scaled_copy(src: torch.Tensor, n: int, stride: int, scale: float, block: int, **kwargs) -> torch.Tensor:
    dst = torch.zeros(n, dtype=src.dtype, device=src.device)
    _scaled_copy_kernel[(triton.cdiv(n, block),)](src, dst, n, stride, scale, BLOCK=block, **kwargs)
    return dst


def test_key_separates_what_triton_specializes_on() -> None:
    base = torch.zeros(64, device="cuda")
    reference = specialization_key((base, 16, 1, 1.5, True, None))
    assert specialization_key((base, 32, 1, 2.5, True, None)) == reference
    for changed in [
        (base[1:], 16, 1, 1.5, True, None),  # 16-byte alignment
        (base.half(), 16, 1, 1.5, True, None),  # dtype
        (base, 17, 1, 1.5, True, None),  # multiple of 16
        (base, 16, 2, 1.5, True, None),  # equal to 1
        (base, 1 << 40, 1, 1.5, True, None),  # 64-bit
        (base, 16, 1, 1.5, False, None),  # a bool's value
    ]:
        assert specialization_key(changed) != reference
    assert specialization_key((base, torch.tensor(3).numpy())) is None  # unknown type: JITFunction.run


def test_cached_launches_match_the_jit_path_for_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not launch_hooks_installed()
    jit_runs = []
    jit_run = _scaled_copy_kernel.function.run
    monkeypatch.setattr(
        _scaled_copy_kernel.function, "run", lambda *a, **k: jit_runs.append(1) or jit_run(*a, **k)
    )
    src = torch.arange(4096, dtype=torch.float32, device="cuda")
    cases = [
        dict(src=src, n=1000, stride=1, scale=2.0, block=128),
        dict(src=src, n=1000, stride=1, scale=-0.5, block=128),  # same variant, other float
        dict(src=src[1:], n=999, stride=1, scale=2.0, block=128),  # unaligned pointer, odd n
        dict(src=src, n=512, stride=4, scale=2.0, block=128),  # stride not 1
        dict(src=src, n=1000, stride=1, scale=2.0, block=256),  # other constexpr
        dict(src=src, n=1000, stride=1, scale=2.0, block=128, SHIFT=3),  # a defaulted constexpr given
    ]
    for case in cases:
        for repeat in range(2):  # the first call goes through JITFunction.run, the second is cached
            runs_before = len(jit_runs)
            got = _scaled_copy(**case)
            assert len(jit_runs) == runs_before + (repeat == 0 and case is not cases[1])
            source = case["src"][: case["n"] * case["stride"] : case["stride"]]
            expected = source * case["scale"] + case.get("SHIFT", 0)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(_scaled_copy_kernel._compiled) == 5  # the second case reused the first's kernel


def test_fitserve_kernels_on_the_cached_path() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=generator)
    for rows in (1, 7, 64):
        x = torch.randn(rows + 1, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
        for view in (x[:rows], x[1:]):  # a row offset of 2 KiB keeps the alignment; both are launched twice
            first, second = rms_norm(view, weight, 1e-6), rms_norm(view, weight, 1e-6)
            torch.testing.assert_close(first, second, rtol=0, atol=0)
            torch.testing.assert_close(first, rms_norm_reference(view, weight, 1e-6), rtol=2e-2, atol=2e-2)
        residual = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
        h = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
        expected_residual = h.float() + residual.float()
        out, new_residual = fused_add_rms_norm(h.clone(), residual.clone(), weight, 1e-6)
        torch.testing.assert_close(new_residual.float(), expected_residual, rtol=1e-2, atol=1e-2)


def test_an_installed_launch_hook_sees_every_launch() -> None:
    from triton import knobs

    seen = []

    def hook(metadata) -> None:
        seen.append(metadata)

    src = torch.arange(256, dtype=torch.float32, device="cuda")
    _scaled_copy(src, 256, 1, 1.0, 128)  # cached before the hook
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch_hooks_installed()
        _scaled_copy(src, 256, 1, 1.0, 128)
        _scaled_copy(src, 256, 1, 1.0, 128)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 2 and not launch_hooks_installed()
