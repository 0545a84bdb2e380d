"""`fitserve doctor`'s tensor-parallel lines: NCCL and peer access between GPUs, gloo ranks on the CPU."""

from __future__ import annotations

import pytest

from fitserve.cli import doctor
from fitserve.cli.doctor import Check, machine_checks, nccl_version, parallel_checks, peer_access
from fitserve.planner.hardware import DeviceSpec, GiB, HostInfo


def host() -> HostInfo:
    return HostInfo(
        cpu_count=16,
        ram_total_bytes=128 * GiB,
        ram_available_bytes=100 * GiB,
        shm_total_bytes=64 * GiB,
        shm_free_bytes=64 * GiB,
        cache_dir="/cache",
        cache_disk_free_bytes=500 * GiB,
        python_version="3.11.9",
        torch_version="2.13.0",
        cuda_runtime_version="12.8",
        driver_version="570.86.15",
    )


def h100(index: int) -> DeviceSpec:
    return DeviceSpec("cuda", index, "NVIDIA H100 80GB HBM3", int(79.19 * GiB), int(79.19 * GiB), (9, 0))


def by_title(checks: list[Check]) -> dict[str, Check]:
    return {check.title: check for check in checks}


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, int], bool | None]:
    """NCCL 2.27.3, and peer access as the returned dict says (default: every pair has it)."""
    links: dict[tuple[int, int], bool | None] = {}
    monkeypatch.setattr(doctor, "nccl_version", lambda: "2.27.3")
    monkeypatch.setattr(doctor, "peer_access", lambda first, second: links.get((first, second), True))
    return links


def test_gpus_that_reach_each_other_pass(nccl: dict) -> None:
    checks = by_title(parallel_checks(host(), [h100(0), h100(1), h100(2)]))
    assert checks["NCCL"].line() == "PASS NCCL: 2.27.3: tensor-parallel ranks all-reduce through it"
    assert checks["GPU peer access"].line() == (
        "PASS GPU peer access: GPU 0<->1 yes, GPU 0<->2 yes, GPU 1<->2 yes: NCCL copies GPU to GPU, and the "
        "decode steps' small sums take fitserve's own all-reduce over peer memory"
    )
    assert checks["tensor parallel"].line() == (
        "PASS tensor parallel: 3 alike GPUs: auto-fit picks the smallest --tensor-parallel-size that fits "
        "the model with a useful batch"
    )


def test_a_pair_without_peer_access_warns_with_the_fix(nccl: dict) -> None:
    nccl[(0, 1)] = False
    check = by_title(parallel_checks(host(), [h100(0), h100(1)]))["GPU peer access"]
    assert check.status == "WARN"
    assert check.detail.startswith("GPU 0<->1 no: NCCL goes through host memory")
    assert "without fitserve's own all-reduce" in check.detail
    assert "CUDA_VISIBLE_DEVICES (nvidia-smi topo -m shows the links)" in check.fix
    nccl[(0, 1)] = None  # the driver would not say
    unknown = by_title(parallel_checks(host(), [h100(0), h100(1)]))["GPU peer access"]
    assert unknown.line() == (
        "WARN GPU peer access: GPU 0<->1 unknown: torch could not say -> fix: check the driver and the links "
        "with nvidia-smi topo -m"
    )


def test_gpus_that_differ_warn_naming_alike_ones(nccl: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    a10 = DeviceSpec("cuda", 1, "NVIDIA A10", int(22.06 * GiB), int(22.06 * GiB), (8, 6))
    check = by_title(parallel_checks(host(), [h100(0), a10, h100(2)]))["tensor parallel"]
    assert check.status == "WARN"
    assert check.detail.endswith("differ: tensor parallel runs on alike GPUs only")
    assert check.fix == "set CUDA_VISIBLE_DEVICES=3,6 (2 alike GPUs) to run tensor parallel over them"


def test_one_gpu_names_nccl_and_a_build_without_it_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "nccl_version", lambda: "2.27.3")
    assert [c.line() for c in parallel_checks(host(), [h100(0)])] == [
        "PASS tensor parallel: 1 GPU visible: tensor_parallel_size 1 (NCCL 2.27.3)"
    ]
    monkeypatch.setattr(doctor, "nccl_version", lambda: None)
    monkeypatch.setattr(doctor, "peer_access", lambda first, second: True)
    missing = by_title(parallel_checks(host(), [h100(0), h100(1)]))["NCCL"]
    assert missing.status == "WARN" and "tensor parallel over the 2 GPUs needs it" in missing.detail
    assert missing.fix.startswith("install a CUDA build of torch")


def test_a_cpu_only_machine_runs_gloo_ranks() -> None:
    (check,) = parallel_checks(host(), [])
    assert check.line() == (
        "PASS tensor parallel: no GPU in use: --tensor-parallel-size N runs N CPU ranks (processes) with "
        "gloo, sharing the 16 cores and the RAM"
    )
    # in the machine's checks, after the GPUs'; --device cpu plans CPU ranks even with GPUs present
    titles = [c.title for c in machine_checks(host(), [], device="cpu")]
    assert titles.index("tensor parallel") < titles.index("host RAM")


def test_the_probes_answer_none_without_cuda() -> None:
    """This CPU build of torch has no NCCL and no GPUs: the probes say so instead of raising."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the probes answer for real")
    assert nccl_version() is None
    assert peer_access(0, 1) is None
