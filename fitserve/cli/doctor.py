"""`fitserve doctor`: what this machine has and what fitserve will do with it, one PASS / WARN / FAIL line
per check; every WARN and FAIL says how to fix it."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fitserve.planner.formats import BF16_MIN_CAPABILITY, format_capability
from fitserve.planner.hardware import DeviceSpec, GiB, HostInfo

MIN_PYTHON = (3, 10)
MIN_GPU_CAPABILITY = (7, 0)  # Triton's oldest supported GPU generation (Volta)
MIN_SHM_BYTES = 1 * GiB  # tensor-parallel workers exchange tensors through /dev/shm
MIN_CACHE_DISK_BYTES = 10 * GiB
MIN_AVAILABLE_RAM_BYTES = 4 * GiB
BUSY_GPU_FRACTION = 0.9  # below this much free, another process holds the GPU
CUDA_TORCH_INSTALL = "pip install torch --index-url https://download.pytorch.org/whl/cu128"
DEV_DIR = Path("/dev")  # where an NVIDIA driver puts its device nodes (nvidia0, nvidia1, ...)
CPU_KERNEL_NAMES = "int4 GEMM, decode attention, RMSNorm, rotary and SiLU"


@dataclass(frozen=True)
class Check:
    status: str  # PASS | WARN | FAIL
    title: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" -> fix: {self.fix}" if self.fix and self.status != "PASS" else ""
        return f"{self.status} {self.title}: {self.detail}{fix}"


def machine_checks(
    host: HostInfo,
    gpus: Sequence[DeviceSpec],
    device: str = "auto",
    dtype: str = "auto",
    gpu_memory_utilization: float | None = None,
) -> list[Check]:
    """One Check per part of the machine. `device`, `dtype` and `gpu_memory_utilization` (None: not set
    by the user) are the flags given to doctor: a fix never names a value the user already set."""
    nvidia = nvidia_hardware(host)
    checks = [_python_check(host), _torch_check(host, gpus, nvidia)]
    if gpus or nvidia is not None:
        checks.append(_driver_check(host))
    checks += [_gpu_check(gpu, dtype, gpu_memory_utilization) for gpu in gpus]
    checks += kernel_path_checks(gpus if device != "cpu" else [])
    checks += parallel_checks(host, [] if device == "cpu" else gpus)
    checks += [_ram_check(host), _shm_check(host, gpus), _disk_check(host), _paths_check(gpus)]
    if not gpus or device == "cpu":
        checks.append(cpu_kernels_check())
    return checks


def kernel_path_checks(gpus: Sequence[DeviceSpec]) -> list[Check]:
    """The path each kernel family takes (worker/kernel_paths.py): once per compute capability present, or
    for the generation FITSERVE_KERNEL_TARGET forces (with or without a GPU)."""
    from fitserve.kernels.capability import KERNEL_TARGET_ENV, forced

    target = forced()
    if target is not None:
        how = f"{KERNEL_TARGET_ENV} forces the choices of compute capability {format_capability(target)}"
        return [_kernel_paths_check(target, f"kernel paths ({how})")]
    present = sorted({g.capability for g in gpus if g.capability and g.capability >= MIN_GPU_CAPABILITY})
    return [
        _kernel_paths_check(c, f"kernel paths (compute capability {format_capability(c)})") for c in present
    ]


def _kernel_paths_check(capability: tuple[int, int], title: str) -> Check:
    try:
        from fitserve.worker.kernel_paths import describe_kernel_paths

        return Check("PASS", title, describe_kernel_paths(capability))
    except ImportError as error:  # a CPU machine without Triton, asked about a forced target
        return Check("WARN", title, f"not known here: {error}", "install triton (pip install triton)")


def nvidia_hardware(host: HostInfo) -> str | None:
    """What shows an NVIDIA GPU in this machine, whether or not torch sees it: a device node such as
    /dev/nvidia0, nvidia-smi, or the driver's version; None on a machine without one."""
    nodes = sorted(node.name for node in DEV_DIR.glob("nvidia[0-9]*"))
    if nodes:
        return str(DEV_DIR / nodes[0])
    if shutil.which("nvidia-smi") is not None:
        return "nvidia-smi"
    if host.driver_version is not None:
        return f"NVIDIA driver {host.driver_version}"
    return None


def _python_check(host: HostInfo) -> Check:
    version = tuple(sys.version_info[:2])
    if version < MIN_PYTHON:
        return Check(
            "FAIL", "python", host.python_version, f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer"
        )
    return Check("PASS", "python", host.python_version)


def _torch_check(host: HostInfo, gpus: Sequence[DeviceSpec], nvidia: str | None) -> Check:
    cuda = host.cuda_runtime_version
    if gpus:
        return Check("PASS", "torch", f"{host.torch_version}, CUDA {cuda}, {len(gpus)} GPU(s) visible")
    if nvidia is None:
        build = "a CPU build" if cuda is None else f"a CUDA {cuda} build"
        return Check(
            "PASS",
            "torch",
            f"{host.torch_version}, {build}; this machine has no NVIDIA GPU: fitserve runs on the CPU",
        )
    if cuda is None:
        return Check(
            "WARN",
            "torch",
            f"{host.torch_version} is a CPU-only build but this machine has an NVIDIA GPU ({nvidia}): "
            "fitserve runs on the CPU (slow)",
            f"install a CUDA build: {CUDA_TORCH_INSTALL}",
        )
    return Check(
        "WARN",
        "torch",
        f"{host.torch_version} (CUDA {cuda}) sees no GPU although this machine has one ({nvidia}): "
        "fitserve runs on the CPU (slow)",
        "check nvidia-smi, the driver, and CUDA_VISIBLE_DEVICES",
    )


def _driver_check(host: HostInfo) -> Check:
    if host.driver_version is None:
        return Check(
            "WARN", "NVIDIA driver", "not found (no /proc/driver/nvidia/version, no nvidia-smi)", "install it"
        )
    return Check("PASS", "NVIDIA driver", host.driver_version)


def _gpu_check(gpu: DeviceSpec, dtype: str, gpu_memory_utilization: float | None) -> Check:
    detail = (
        f"{gpu.name}, compute capability {format_capability(gpu.capability)}, "
        f"{gpu.total_gib:.2f} GiB total, {gpu.free_gib:.2f} GiB free"
    )
    title = f"GPU {gpu.index}"
    if gpu.capability is not None and gpu.capability < MIN_GPU_CAPABILITY:
        return Check("FAIL", title, detail, "fitserve's Triton kernels need compute capability 7.0 or newer")
    if gpu.free_bytes < BUSY_GPU_FRACTION * gpu.total_bytes:
        held = gpu.total_gib - gpu.free_gib
        fits = math.floor(gpu.free_bytes / gpu.total_bytes * 100) / 100
        busy = f"{detail}; other processes hold {held:.2f} GiB"
        if gpu_memory_utilization is not None and gpu_memory_utilization <= fits:
            return Check(
                "PASS",
                title,
                f"{busy}; your --gpu-memory-utilization {gpu_memory_utilization:g} leaves them room",
            )
        if gpu_memory_utilization is not None:
            fix = (
                f"stop them (nvidia-smi lists them), or lower --gpu-memory-utilization to {fits:.2f} or less"
            )
        else:
            fix = (
                f"stop them (nvidia-smi lists them), or set --gpu-memory-utilization {fits:.2f}"
                " or lower (auto-fit does this when the flag is unset)"
            )
        return Check("WARN", title, busy, fix)
    if gpu.capability is not None and gpu.capability < BF16_MIN_CAPABILITY:
        if dtype == "bfloat16":
            return Check(
                "WARN",
                title,
                f"{detail}; no fast bfloat16 (it needs compute capability 8.0)",
                "use --dtype float16, or leave --dtype out (auto picks float16 here)",
            )
        return Check("PASS", title, f"{detail}; no fast bfloat16, so dtype auto picks float16 here")
    return Check("PASS", title, detail)


def parallel_checks(host: HostInfo, gpus: Sequence[DeviceSpec]) -> list[Check]:
    """What tensor parallel runs on: with GPUs, NCCL's version, whether they are alike, and peer access
    between each pair; without, CPU ranks with gloo."""
    if not gpus:
        return [_cpu_parallel_check(host)]
    version = nccl_version()
    if len(gpus) == 1:
        nccl = f"NCCL {version}" if version else "no NCCL in this torch build"
        return [Check("PASS", "tensor parallel", f"1 GPU visible: tensor_parallel_size 1 ({nccl})")]
    if version is None:
        nccl = Check(
            "WARN",
            "NCCL",
            f"not in this torch build: tensor parallel over the {len(gpus)} GPUs needs it (one GPU runs)",
            f"install a CUDA build of torch (its Linux wheels carry NCCL): {CUDA_TORCH_INSTALL}",
        )
    else:
        nccl = Check("PASS", "NCCL", f"{version}: tensor-parallel ranks all-reduce through it")
    return [nccl, _alike_check(gpus), _peer_access_check(gpus)]


def nccl_version() -> str | None:
    """NCCL's version in this torch build ("2.21.5"), or None without one (a CPU build)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, AssertionError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def peer_access(first: int, second: int) -> bool | None:
    """Whether GPU `first` reads GPU `second`'s memory directly (NVLink or PCIe P2P); None if unknown."""
    try:
        return bool(torch.cuda.can_device_access_peer(first, second))
    except (AttributeError, RuntimeError, AssertionError, ValueError):
        return None


def _alike_check(gpus: Sequence[DeviceSpec]) -> Check:
    from fitserve.planner.fit_parallel import alike_groups, alike_prefix, visible_devices_hint

    if alike_prefix(gpus) == len(gpus):
        return Check(
            "PASS",
            "tensor parallel",
            f"{len(gpus)} alike GPUs: auto-fit picks the smallest --tensor-parallel-size that fits the model "
            "with a useful batch",
        )
    different = gpus[alike_prefix(gpus)]
    largest = alike_groups(gpus)[0]
    if len(largest) > 1:
        hint = visible_devices_hint([gpu.index for gpu in largest])
        fix = f"set {hint} ({len(largest)} alike GPUs) to run tensor parallel over them"
    else:
        fix = "run on one GPU (tensor_parallel_size 1), or add alike GPUs"
    return Check(
        "WARN",
        "tensor parallel",
        f"{gpus[0].label()} and {different.label()} differ: tensor parallel runs on alike GPUs only",
        fix,
    )


def _peer_access_check(gpus: Sequence[DeviceSpec]) -> Check:
    pairs = [(a.index, b.index) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    access = {pair: peer_access(*pair) for pair in pairs}
    words = {True: "yes", False: "no", None: "unknown"}
    detail = ", ".join(f"GPU {a}<->{b} {words[found]}" for (a, b), found in access.items())
    if all(found for found in access.values()):
        return Check(
            "PASS",
            "GPU peer access",
            f"{detail}: NCCL copies GPU to GPU, and the decode steps' small sums take fitserve's own "
            "all-reduce over peer memory",
        )
    if any(found is None for found in access.values()):
        return Check(
            "WARN",
            "GPU peer access",
            f"{detail}: torch could not say",
            "check the driver and the links with nvidia-smi topo -m",
        )
    return Check(
        "WARN",
        "GPU peer access",
        f"{detail}: NCCL goes through host memory between the pairs without it, and a group with such a "
        "pair sums through NCCL alone, without fitserve's own all-reduce (slower tensor-parallel steps)",
        "pick GPUs that reach each other with CUDA_VISIBLE_DEVICES (nvidia-smi topo -m shows the links), "
        "or check that the IOMMU or PCIe ACS settings do not block peer access",
    )


def _cpu_parallel_check(host: HostInfo) -> Check:
    distributed = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    if not distributed:
        return Check(
            "WARN",
            "tensor parallel",
            "this torch build has no gloo backend: on the CPU --tensor-parallel-size stays 1",
            "install a torch build with torch.distributed (the PyPI wheels for Linux have it)",
        )
    return Check(
        "PASS",
        "tensor parallel",
        f"no GPU in use: --tensor-parallel-size N runs N CPU ranks (processes) with gloo, sharing the "
        f"{host.cpu_count} cores and the RAM",
    )


def _ram_check(host: HostInfo) -> Check:
    detail = f"{host.ram_total_bytes / GiB:.1f} GiB total, {host.ram_available_bytes / GiB:.1f} GiB available"
    if host.ram_available_bytes < MIN_AVAILABLE_RAM_BYTES:
        return Check(
            "WARN", "host RAM", detail, "close other programs; loading a model stages its weights in RAM"
        )
    return Check("PASS", "host RAM", detail)


def _shm_check(host: HostInfo, gpus: Sequence[DeviceSpec]) -> Check:
    if host.shm_total_bytes is None:
        return Check("WARN", "/dev/shm", "absent", "mount a tmpfs at /dev/shm (docker: --ipc=host)")
    detail = f"{host.shm_total_bytes / GiB:.2f} GiB, {(host.shm_free_bytes or 0) / GiB:.2f} GiB free"
    if host.shm_total_bytes < MIN_SHM_BYTES and len(gpus) > 1:
        return Check(
            "WARN",
            "/dev/shm",
            f"{detail}: too small for tensor-parallel workers",
            "run docker with --ipc=host or --shm-size=16g",
        )
    return Check("PASS", "/dev/shm", detail)


def _disk_check(host: HostInfo) -> Check:
    detail = f"{host.cache_disk_free_bytes / GiB:.1f} GiB free for the model cache {host.cache_dir}"
    if host.cache_disk_free_bytes < MIN_CACHE_DISK_BYTES:
        return Check(
            "WARN",
            "disk",
            detail,
            "free space there, or point FITSERVE_CACHE_DIR (and HF_HOME) at a larger disk",
        )
    return Check("PASS", "disk", detail)


def _paths_check(gpus: Sequence[DeviceSpec]) -> Check:
    from fitserve.layers.attention import get_attention_backend

    device = "cuda" if gpus else "cpu"
    try:
        backend = type(get_attention_backend(device)).__name__
    except (ImportError, ValueError) as error:
        return Check(
            "FAIL", "attention", f"no backend for {device}: {error}", "reinstall fitserve with its kernels"
        )
    if device == "cpu":
        blas = "oneDNN" if torch.backends.mkldnn.is_available() else "torch's own kernels"
        return Check("PASS", "compute paths", f"attention {backend} on the CPU; GEMM torch.matmul via {blas}")
    triton = importlib.util.find_spec("triton") is not None
    detail = f"attention {backend}; GEMM cuBLAS through torch.matmul"
    if not triton:
        return Check("WARN", "compute paths", f"{detail}; Triton is not installed", "pip install triton")
    return Check("PASS", "compute paths", f"{detail}; Triton installed")


def cpu_kernels_check() -> Check:
    """Whether fitserve's C kernels for the CPU (fitserve/layers/cpu/c_kernels) build, pass their
    self-check and load here, and which kernel set (avx512, avx_vnni, avx2) runs; builds it if need be
    (about two seconds, then cached)."""
    from fitserve.layers.cpu.c_kernels import library

    title = "CPU kernels"
    if not library.kernels_enabled():
        return Check(
            "WARN",
            title,
            f"turned off by {library.ENV_SWITCH}={os.environ.get(library.ENV_SWITCH)}: "
            "torch's operations run instead (slower)",
            f"unset {library.ENV_SWITCH} to use them",
        )
    with _quiet_kernel_log():
        kernels = library.load_cpu_kernels()
    if kernels is not None:
        chosen = kernels.kernel_set
        forced = os.environ.get(library.ENV_SWITCH, "").strip().lower() == chosen.name
        how = f"forced by {library.ENV_SWITCH}={chosen.name}" if forced else "the best this CPU has"
        # where a better set is missing for want of CPU flags, which (an AVX2 machine runs slower kernels)
        better = [
            s for s in library.KERNEL_SETS[: library.KERNEL_SETS.index(chosen)] if library.missing_flags(s)
        ]
        if better and not forced:
            how += f"; {better[0].name} would need {', '.join(sorted(library.missing_flags(better[0])))}"
        return Check(
            "PASS",
            title,
            f"{CPU_KERNEL_NAMES} built for this CPU and loaded, kernel set {chosen.name} "
            f"({chosen.description}; {how}), in place of torch's ({kernels.path})",
        )
    reason = library.unavailable_reason() or "they failed to build or load earlier in this process"
    return Check(
        "WARN",
        title,
        f"not used: {reason}; torch's operations run instead (slower)",
        _cpu_kernels_fix(reason),
    )


def _cpu_kernels_fix(reason: str) -> str:
    from fitserve.layers.cpu.c_kernels import library

    if reason.startswith("no C compiler"):
        return "install a C compiler (e.g. apt install gcc), or point CC at one"
    if "x86-64" in reason or "need at the least" in reason:
        return "none on this CPU (they need x86-64 with AVX2 + FMA): fitserve runs, more slowly"
    if reason.startswith(library.ENV_SWITCH):
        return f"unset {library.ENV_SWITCH}, or set it to a kernel set this CPU has"
    if "omp" in reason.lower():
        return "install a compiler with OpenMP (gcc with libgomp), or point CC at one"
    return "point CC at a working gcc or clang with OpenMP; if it still fails, report the reason above"


@contextlib.contextmanager
def _quiet_kernel_log() -> Iterator[None]:
    """Keeps the library's "CPU kernels: ..." log records out of the log: the check's line says it."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("CPU kernels:")

    fitserve_logger = logging.getLogger("fitserve")
    level = fitserve_logger.level
    fitserve_logger.addFilter(keep)
    if not fitserve_logger.isEnabledFor(logging.INFO):
        fitserve_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        fitserve_logger.removeFilter(keep)
        fitserve_logger.setLevel(level)
