"""The machine the plan is for: GPUs (probed through torch.cuda, or assumed with --assume-gpus), the CPU
host's memory, /dev/shm, the model cache's disk, and the software versions `fitserve doctor` prints.

GiB throughout is 2**30 bytes, as torch.cuda.mem_get_info and vLLM's logs count it.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

GiB = 1024**3
MAX_ASSUMED_GPUS = 64
MAX_ASSUMED_GIB = 4096.0
_ASSUME_FORMAT = "COUNTxGiB[@SM], e.g. 1x24, 2x20 or 1x79.19@9.0 (several groups: 1x24,1x8)"
_GROUP_PATTERN = re.compile(r"^(?P<count>[^xX@]*)[xX](?P<size>[^@]*)(@(?P<sm>.*))?$")


@dataclass(frozen=True)
class DeviceSpec:
    """One device the plan places weights and KV cache on: a GPU, or the CPU host's memory."""

    kind: str  # "cuda" or "cpu"
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int] | None = None  # None: not known (an assumed GPU without @SM, or the CPU)
    assumed: bool = False  # from --assume-gpus rather than probed

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    @property
    def free_gib(self) -> float:
        return self.free_bytes / GiB

    def label(self) -> str:
        if self.kind == "cpu":
            return self.name
        sm = f", SM {self.capability[0]}.{self.capability[1]}" if self.capability else ""
        return f"GPU {self.index} ({self.name}, {self.total_gib:.2f} GiB{sm})"


@dataclass(frozen=True)
class HostInfo:
    cpu_count: int
    ram_total_bytes: int
    ram_available_bytes: int
    shm_total_bytes: int | None  # None: no /dev/shm
    shm_free_bytes: int | None
    cache_dir: str  # fitserve's model cache
    cache_disk_free_bytes: int
    python_version: str
    torch_version: str
    cuda_runtime_version: str | None  # the CUDA torch was built with; None for a CPU build
    driver_version: str | None


def parse_assume_gpus(text: str) -> tuple[DeviceSpec, ...]:
    """GPUs from COUNTxGiB[@SM]: "2x20" is two 20 GiB GPUs, "1x79.5@8.0" one of 79.5 GiB, SM 8.0.

    Raises ValueError naming the bad value and the accepted form.
    """
    if not text or not text.strip():
        raise ValueError(f"--assume-gpus {text!r} is empty: write {_ASSUME_FORMAT}")
    devices: list[DeviceSpec] = []
    for group in text.replace(" ", "").split(","):
        count, gib, capability = _parse_group(group, text)
        for _ in range(count):
            total = int(round(gib * GiB))
            name = "assumed GPU"
            devices.append(DeviceSpec("cuda", len(devices), name, total, total, capability, assumed=True))
    if len(devices) > MAX_ASSUMED_GPUS:
        raise ValueError(
            f"--assume-gpus {text!r} describes {len(devices)} GPUs, above the maximum {MAX_ASSUMED_GPUS}: "
            "plan for the GPUs of one host"
        )
    return tuple(devices)


def _parse_group(group: str, text: str) -> tuple[int, float, tuple[int, int] | None]:
    match = _GROUP_PATTERN.match(group)
    if match is None:
        hint = f" (did you mean 1x{group}?)" if _is_number(group) else ""
        raise ValueError(f"--assume-gpus {text!r}: {group!r} is not COUNTxGiB{hint}: write {_ASSUME_FORMAT}")
    count_text, size_text, sm_text = match["count"], match["size"], match["sm"]
    if not count_text.isdigit() or int(count_text) < 1:
        raise ValueError(
            f"--assume-gpus {text!r}: GPU count {count_text!r} is not a whole number of 1 or more: "
            f"write {_ASSUME_FORMAT}"
        )
    gib = _parse_gib(size_text, text)
    capability = None if sm_text is None else _parse_capability(sm_text, text)
    return int(count_text), gib, capability


def _parse_gib(size_text: str, text: str) -> float:
    lowered = size_text.lower()
    if lowered.endswith("gb") and _is_number(lowered[:-2]):
        gib = float(lowered[:-2]) * 1e9 / GiB
        raise ValueError(
            f"--assume-gpus {text!r}: {size_text!r} is in GB (10**9 bytes); the planner counts GiB (2**30): "
            f"write {gib:.2f} (a '{lowered[:-2]} GB' card reports about that many GiB; torch.cuda shows the "
            "exact figure)"
        )
    number = lowered.removesuffix("gib").removesuffix("g")
    if not _is_number(number):
        raise ValueError(
            f"--assume-gpus {text!r}: memory {size_text!r} is not a number of GiB: write {_ASSUME_FORMAT}"
        )
    gib = float(number)
    if not 0 < gib <= MAX_ASSUMED_GIB:
        raise ValueError(
            f"--assume-gpus {text!r}: memory {gib:g} GiB is outside (0, {MAX_ASSUMED_GIB:g}]: "
            "give each GPU's memory in GiB, e.g. 24 or 79.19"
        )
    return gib


def _parse_capability(sm_text: str, text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d{1,2})\.(\d)", sm_text)
    if match is None:
        hint = ""
        if re.fullmatch(r"\d{2,3}", sm_text):
            hint = f" (did you mean {sm_text[:-1]}.{sm_text[-1]}?)"
        raise ValueError(
            f"--assume-gpus {text!r}: compute capability {sm_text!r} is not MAJOR.MINOR{hint}: write it as "
            "torch.cuda.get_device_capability() gives it, e.g. @7.5 (T4, 2080 Ti), @8.0 (A100), @8.6 (3090), "
            "@8.9 (4090, L4), @9.0 (H100)"
        )
    major, minor = int(match[1]), int(match[2])
    if major < 3:
        raise ValueError(
            f"--assume-gpus {text!r}: compute capability {major}.{minor} is below 3.0, older than any GPU "
            "torch supports: give the GPU's real capability"
        )
    return major, minor


def _is_number(text: str) -> bool:
    try:
        return float(text) == float(text)  # rejects "nan"
    except ValueError:
        return False


def probe_gpus() -> tuple[DeviceSpec, ...]:
    """Every CUDA GPU torch sees, with its free memory now (another process may hold some)."""
    if not torch.cuda.is_available():
        return ()
    return tuple(gpu_device_spec(index) for index in range(torch.cuda.device_count()))


def gpu_device_spec(index: int) -> DeviceSpec:
    """The GPU at `index`: name, capability, total and free memory as torch.cuda reports them now."""
    free, total = torch.cuda.mem_get_info(index)
    major, minor = torch.cuda.get_device_capability(index)
    return DeviceSpec("cuda", index, torch.cuda.get_device_name(index), int(total), int(free), (major, minor))


def cpu_device(host: HostInfo) -> DeviceSpec:
    """The CPU as the device: its memory is the host RAM available now."""
    name = f"CPU ({host.cpu_count} cores, {host.ram_total_bytes / GiB:.1f} GiB RAM)"
    return DeviceSpec("cpu", 0, name, host.ram_total_bytes, host.ram_available_bytes)


def probe_host(cache_dir: str | None = None) -> HostInfo:
    from fitserve.paths import fitserve_cache_dir

    meminfo = read_meminfo()
    cache = cache_dir or str(fitserve_cache_dir())
    shm = Path("/dev/shm")
    shm_usage = shutil.disk_usage(shm) if shm.is_dir() else None
    return HostInfo(
        cpu_count=os.cpu_count() or 1,
        ram_total_bytes=meminfo.get("MemTotal", 0),
        ram_available_bytes=meminfo.get("MemAvailable", meminfo.get("MemFree", 0)),
        shm_total_bytes=shm_usage.total if shm_usage else None,
        shm_free_bytes=shm_usage.free if shm_usage else None,
        cache_dir=cache,
        cache_disk_free_bytes=shutil.disk_usage(_existing_ancestor(Path(cache))).free,
        python_version=platform.python_version(),
        torch_version=torch.__version__,
        cuda_runtime_version=torch.version.cuda,
        driver_version=nvidia_driver_version(),
    )


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes ("MemTotal: 16318580 kB" -> {"MemTotal": 16710225920})."""
    values: dict[str, int] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
            values[key.strip()] = int(parts[0]) * scale
    return values


def nvidia_driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from /proc or nvidia-smi; None without one."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
        if match:
            return match[1]
    except OSError:
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = result.stdout.strip().splitlines()[:1]
    return first[0].strip() if result.returncode == 0 and first else None


def _existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")
