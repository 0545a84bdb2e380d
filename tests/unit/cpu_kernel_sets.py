"""The C kernel sets (fitserve/layers/cpu/c_kernels/library.py) for tests that run once per set: every set
this machine's CPU has runs; the others show as skipped, naming what the CPU lacks."""

from __future__ import annotations

import pytest

from fitserve.layers.cpu.c_kernels import library

KERNEL_SET_NAMES = [kernel_set.name for kernel_set in library.KERNEL_SETS]


def use_kernel_set(name: str, monkeypatch: pytest.MonkeyPatch) -> library.CpuKernels:
    """The named set's kernels, with FITSERVE_CPU_KERNELS naming it for the test (so the layers that call
    load_cpu_kernels() take it too); skips the test where the set cannot run here."""
    lacking = library.missing_flags(library.SETS_BY_NAME[name])
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(sorted(lacking))} for the {name} kernels")
    kernels = library.load_kernel_set(name)
    if kernels is None:
        pytest.skip(f"the {name} kernels do not build here: {library.set_failure(name)}")
    monkeypatch.setenv(library.ENV_SWITCH, name)
    assert library.load_cpu_kernels() is kernels
    return kernels
