"""`fitserve doctor`: what this machine has and what fitserve will do with it, one PASS / WARN / FAIL line
per check; every WARN and FAIL says how to fix it."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Check:
    status: str  # PASS | WARN | FAIL
    title: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" -> fix: {self.fix}" if self.fix and self.status != "PASS" else ""
        return f"{self.status} {self.title}: {self.detail}{fix}"


def machine_checks(host: HostInfo, gpus: Sequence[DeviceSpec]) -> list[Check]:
    checks = [_python_check(host), _torch_check(host, gpus)]
    if torch.version.cuda is not None or gpus:
        checks.append(_driver_check(host))
    checks += [_gpu_check(gpu) for gpu in gpus]
    checks += [_ram_check(host), _shm_check(host, gpus), _disk_check(host), _paths_check(gpus)]
    return checks


def _python_check(host: HostInfo) -> Check:
    version = tuple(sys.version_info[:2])
    if version < MIN_PYTHON:
        return Check(
            "FAIL", "python", host.python_version, f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer"
        )
    return Check("PASS", "python", host.python_version)


def _torch_check(host: HostInfo, gpus: Sequence[DeviceSpec]) -> Check:
    cuda = host.cuda_runtime_version
    if gpus:
        return Check("PASS", "torch", f"{host.torch_version}, CUDA {cuda}, {len(gpus)} GPU(s) visible")
    if cuda is None:
        return Check(
            "WARN",
            "torch",
            f"{host.torch_version} is a CPU-only build: fitserve runs on the CPU (slow)",
            f"on a machine with an NVIDIA GPU install a CUDA build: {CUDA_TORCH_INSTALL}",
        )
    return Check(
        "WARN",
        "torch",
        f"{host.torch_version} (CUDA {cuda}) sees no GPU: fitserve runs on the CPU (slow)",
        "check nvidia-smi, the driver, and CUDA_VISIBLE_DEVICES",
    )


def _driver_check(host: HostInfo) -> Check:
    if host.driver_version is None:
        return Check(
            "WARN", "NVIDIA driver", "not found (no /proc/driver/nvidia/version, no nvidia-smi)", "install it"
        )
    return Check("PASS", "NVIDIA driver", host.driver_version)


def _gpu_check(gpu: DeviceSpec) -> Check:
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
        return Check(
            "WARN",
            title,
            f"{detail}; other processes hold {held:.2f} GiB",
            f"stop them (nvidia-smi lists them), or set --gpu-memory-utilization {fits:.2f}"
            " or lower (auto-fit does this when the flag is unset)",
        )
    if gpu.capability is not None and gpu.capability < BF16_MIN_CAPABILITY:
        return Check(
            "WARN", title, f"{detail}; no fast bfloat16", "none needed: dtype auto picks float16 here"
        )
    return Check("PASS", title, detail)


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
