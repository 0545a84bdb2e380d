"""Builds fitserve's C kernels for this CPU on first use and loads them (ctypes).

The sources (every .c file beside this module: int4_gemm.c, int4_pack.c, decode_attention.c,
elementwise.c) ship with the package; one shared library is compiled from them once per machine kind
with the system C compiler (`$CC`, else `cc`) as `-O3 -march=native -ffp-contract=off -fopenmp` and
cached under `fitserve_cache_dir()/cpu_kernels/<key>/`, the key covering the sources (and their header), the
compiler's version and the CPU's model and flags, so a cache shared between machines never hands one
another's build. A build takes about a second.

When there is no compiler, the CPU lacks the instructions (the build fails), or the built library
gives a wrong answer on a small self-check, `load_cpu_kernels()` returns None and says why once in
the log; callers then use torch's operations. FITSERVE_CPU_KERNELS=0 turns the C kernels off.

OpenMP: the library links `libgomp.so.1`, which a torch CPU build has already loaded, so its threads
are torch's pool; each call is told how many to use (torch.get_num_threads()).

The Python side of each kernel (argument checks, ctypes signature, self-check) lives in the module
named like its source: int4_gemm.py, int4_pack.py, decode_attention.py, elementwise.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from fitserve.layers.cpu.c_kernels.decode_attention import DecodeAttention
from fitserve.layers.cpu.c_kernels.elementwise import Elementwise
from fitserve.layers.cpu.c_kernels.int4_gemm import Int4Gemm
from fitserve.layers.cpu.c_kernels.int4_pack import Int4Pack
from fitserve.paths import fitserve_cache_dir

logger = logging.getLogger("fitserve")

ENV_SWITCH = "FITSERVE_CPU_KERNELS"
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBRARY_NAME = "libfitserve_cpu.so"

_lock = threading.Lock()
_loaded: dict[str, CpuKernels | None] = {}
# (FITSERVE_CPU_KERNELS as last read, the kernels for it): load_cpu_kernels' lock-free fast path
_answer: tuple[str | None, CpuKernels | None] | None = None
_unavailable_reason: str | None = None


def kernels_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class CpuKernels:
    """The built library's kernels."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.int4_gemm = Int4Gemm(library)
        self.int4_pack = Int4Pack(library)
        self.decode_attention = DecodeAttention(library)
        self.elementwise = Elementwise(library)


def load_cpu_kernels() -> CpuKernels | None:
    """The C kernels built for this machine, or None (logged once) when they cannot be had here.

    Called per layer per step, so its answer is remembered (per value of FITSERVE_CPU_KERNELS)."""
    switch = os.environ.get(ENV_SWITCH)
    remembered = _answer
    if remembered is not None and remembered[0] == switch:
        return remembered[1]
    with _lock:
        if not kernels_enabled():
            kernels = None
        else:
            if "cpu" not in _loaded:
                _loaded["cpu"] = _build_and_check()
            kernels = _loaded["cpu"]
        _set_answer((switch, kernels))
        return kernels


def _set_answer(answer: tuple[str | None, CpuKernels | None] | None) -> None:
    global _answer
    _answer = answer


def build_blocker() -> str | None:
    """Why the kernels cannot even be built here (not x86-64, no C compiler), or None; found without
    building (the planner predicts from it, with the CPU's flags)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the C kernels are written for x86-64 AVX-512, not {platform.machine()}"
    if _compiler() is None:
        return "no C compiler found (set CC, or install gcc)"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build_and_check() -> CpuKernels | None:
    blocker = build_blocker()
    if blocker is not None:
        return _unavailable(blocker)
    try:
        path = _built_library(str(_compiler()))  # build_blocker found it
        kernels = CpuKernels(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        return _unavailable(f"building {', '.join(s.name for s in SOURCES)} failed ({_first_line(error)})")
    problem = (
        kernels.int4_gemm.self_check()
        or kernels.int4_pack.self_check()
        or kernels.decode_attention.self_check()
        or kernels.elementwise.self_check()
    )
    if problem:
        return _unavailable(problem)
    logger.info(
        "CPU kernels: int4 GEMM, decode attention, RMSNorm, rotary and SiLU built for this CPU (%s)", path
    )
    return kernels


def _built_library(compiler: str) -> Path:
    key = _cache_key(compiler)
    directory = fitserve_cache_dir() / "cpu_kernels" / key
    path = directory / LIBRARY_NAME
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / path.name
        subprocess.run(
            [compiler, *COMPILE_FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, path)  # atomic: a concurrent start sees a whole library or none
    return path


def _cache_key(compiler: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    digest = hashlib.sha256()
    parts = [source.read_bytes() for source in (*SOURCES, *sorted(Path(__file__).parent.glob("*.h")))]
    for part in (*parts, version.encode(), " ".join(COMPILE_FLAGS).encode(), _cpu_identity()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_identity() -> bytes:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted))).encode()


def _unavailable(reason: str) -> None:
    global _unavailable_reason
    _unavailable_reason = reason
    logger.info("CPU kernels: not used (%s); torch's operations run instead", reason)
    return None


def unavailable_reason() -> str | None:
    """Why the last build-and-check in this process gave no kernels (None: it gave them, or none ran)."""
    return _unavailable_reason


def _first_line(error: BaseException) -> str:
    stderr = getattr(error, "stderr", None)
    lines = (stderr or str(error)).strip().splitlines()
    errors = [line for line in lines if "error" in line]
    return (errors or lines or [type(error).__name__])[0]
