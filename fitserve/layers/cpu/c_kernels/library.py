"""Builds fitserve's C kernels for this CPU on first use and loads them (ctypes).

The sources (every .c file beside this module: int4_gemm.c, int4_pack.c, decode_attention.c,
elementwise.c) ship with the package and are written once, on vec16.h's 16-lane vectors, for three kernel
sets, best first:
  avx512    AVX-512 F/BW with VNNI (`-march=native`);
  avx_vnni  AVX2 + FMA with AVX-VNNI for the int4 GEMM's int8 dot products (`-march=native -mno-avx512f`);
  avx2      AVX2 + FMA (+ F16C), the int8 dot products by VPMADDUBSW (`-march=native -mno-avx512f`).
All three compute the same bits (the tests compare them). The best set the CPU's flags (/proc/cpuinfo)
allow is built, as one shared library per set with the system C compiler (`$CC`, else `cc`) and
`-O3 -ffp-contract=off -fopenmp`, and cached under `fitserve_cache_dir()/cpu_kernels/<key>/`, the key
covering the sources (and their headers), the compiler's version, the set's flags and the CPU's model and
flags, so a cache shared between machines never hands one another's build. A build takes about two
seconds; a warm start only loads it. Each source refuses (#error) to build for a set whose instructions
`-march=native` does not enable, so even without /proc/cpuinfo no set runs on a CPU that lacks it.

FITSERVE_CPU_KERNELS picks: unset, `1` or `auto` the best set here (the next one when it fails to build or
to pass its self-check); `avx512`, `avx_vnni` or `avx2` that set only (for tests and benchmarks; refused
with a reason where the CPU lacks it); `0` or `torch` none. When no set can be had (no compiler, not
x86-64, no AVX2, a wrong answer on the small self-check), `load_cpu_kernels()` returns None and says why
once in the log; callers then use torch's operations.

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
from dataclasses import dataclass
from pathlib import Path

from fitserve.layers.cpu.c_kernels.decode_attention import DecodeAttention
from fitserve.layers.cpu.c_kernels.elementwise import Elementwise
from fitserve.layers.cpu.c_kernels.int4_gemm import Int4Gemm
from fitserve.layers.cpu.c_kernels.int4_pack import Int4Pack
from fitserve.paths import fitserve_cache_dir

logger = logging.getLogger("fitserve")

ENV_SWITCH = "FITSERVE_CPU_KERNELS"
OFF_VALUES = ("0", "false", "no", "off", "torch")
AUTO_VALUES = ("", "1", "true", "yes", "on", "auto")
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBRARY_NAME = "libfitserve_cpu.so"


@dataclass(frozen=True)
class KernelSet:
    """One build of the C kernels: its name, what it runs on, the CPU flags it needs, its compiler flags."""

    name: str
    description: str
    cpu_flags: frozenset[str]  # as /proc/cpuinfo names them
    compile_flags: tuple[str, ...]


KERNEL_SETS = (
    KernelSet(
        "avx512", "AVX-512 with VNNI", frozenset({"avx512f", "avx512bw", "avx512_vnni"}), ("-march=native",)
    ),
    KernelSet(
        "avx_vnni",
        "AVX2 + FMA with AVX-VNNI",
        frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
        ("-march=native", "-mno-avx512f", "-DFS_WANT_AVX_VNNI"),
    ),
    KernelSet(
        "avx2",
        "AVX2 + FMA",
        frozenset({"avx2", "fma", "f16c"}),
        ("-march=native", "-mno-avx512f", "-DFS_AVX2_ONLY"),
    ),
)
SETS_BY_NAME = {kernel_set.name: kernel_set for kernel_set in KERNEL_SETS}

_lock = threading.Lock()
_loaded: dict[str, CpuKernels | None] = {}  # per kernel set name: its kernels, or None (it failed here)
_failures: dict[str, str] = {}  # per kernel set name: why it failed
# (FITSERVE_CPU_KERNELS as last read, the kernels for it): load_cpu_kernels' lock-free fast path
_answer: tuple[str | None, CpuKernels | None] | None = None
_unavailable_reason: str | None = None


def kernels_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in OFF_VALUES


def requested_set() -> str | None:
    """What FITSERVE_CPU_KERNELS asks for: "auto", a kernel set's name, or None (off). Raises ValueError
    for any other value."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in OFF_VALUES:
        return None
    if value in AUTO_VALUES:
        return "auto"
    if value in SETS_BY_NAME:
        return value
    names = ", ".join(SETS_BY_NAME)
    raise ValueError(
        f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r} names no kernel set: set it to auto, one of {names}, "
        "or 0 (torch's operations)"
    )


class CpuKernels:
    """The built library's kernels, and the kernel set it was built for."""

    def __init__(self, library: ctypes.CDLL, path: Path, kernel_set: KernelSet) -> None:
        self.path = path
        self.kernel_set = kernel_set
        self.int4_gemm = Int4Gemm(library)
        self.int4_pack = Int4Pack(library)
        self.decode_attention = DecodeAttention(library)
        self.elementwise = Elementwise(library)

    @property
    def set_name(self) -> str:
        return self.kernel_set.name


def load_cpu_kernels() -> CpuKernels | None:
    """The C kernels FITSERVE_CPU_KERNELS asks for (the best set for this CPU unless it names one), or
    None (logged once) when they cannot be had here.

    Called per layer per step, so its answer is remembered (per value of FITSERVE_CPU_KERNELS)."""
    switch = os.environ.get(ENV_SWITCH)
    remembered = _answer
    if remembered is not None and remembered[0] == switch:
        return remembered[1]
    with _lock:
        try:
            wanted = requested_set()
        except ValueError as error:
            kernels = _unavailable(str(error))
        else:
            if wanted is None:
                kernels = None
            elif wanted == "auto":
                kernels = _best_set()
            else:
                kernels = _forced_set(SETS_BY_NAME[wanted])
        _set_answer((switch, kernels))
        return kernels


def load_kernel_set(name: str) -> CpuKernels | None:
    """The kernels of one set (built and checked once per process), or None where it cannot run here
    (`set_failure(name)` says why). For tests and benchmarks that compare the sets."""
    kernel_set = SETS_BY_NAME[name]
    with _lock:
        return _load(kernel_set)


def set_failure(name: str) -> str | None:
    """Why the named set gave no kernels in this process (None: it gave them, or was not tried)."""
    return _failures.get(name)


def _set_answer(answer: tuple[str | None, CpuKernels | None] | None) -> None:
    global _answer
    _answer = answer


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as /proc/cpuinfo lists them; None where it cannot be read (the builds'
    #error checks then decide)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def missing_flags(kernel_set: KernelSet) -> frozenset[str]:
    """The CPU flags the set needs that this CPU lacks (none where the flags are unknown)."""
    flags = cpu_flags()
    return frozenset() if flags is None else kernel_set.cpu_flags - flags


def supported_sets() -> tuple[KernelSet, ...]:
    """The kernel sets this CPU's flags allow, best first."""
    return tuple(kernel_set for kernel_set in KERNEL_SETS if not missing_flags(kernel_set))


def expected_set() -> KernelSet | None:
    """The set load_cpu_kernels() should give here, found without building: by the switch, the machine,
    a compiler and the CPU's flags (the planner and the doctor predict from it)."""
    try:
        wanted = requested_set()
    except ValueError:
        return None
    if wanted is None or build_blocker() is not None:
        return None
    if wanted != "auto":
        kernel_set = SETS_BY_NAME[wanted]
        return None if missing_flags(kernel_set) else kernel_set
    supported = supported_sets()
    return supported[0] if supported else None


def build_blocker() -> str | None:
    """Why the kernels cannot even be built here (not x86-64, no C compiler), or None; found without
    building (the planner predicts from it, with the CPU's flags)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the C kernels are written for x86-64 (AVX2 or AVX-512), not {platform.machine()}"
    if _compiler() is None:
        return "no C compiler found (set CC, or install gcc)"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _best_set() -> CpuKernels | None:
    blocker = build_blocker()
    if blocker is not None:
        return _unavailable(blocker)
    candidates = supported_sets()
    if not candidates:
        lacking = ", ".join(sorted(missing_flags(KERNEL_SETS[-1])))
        return _unavailable(f"this CPU lacks {lacking}, which the C kernels need at the least (AVX2 + FMA)")
    for kernel_set in candidates:
        kernels = _load(kernel_set)
        if kernels is not None:
            return kernels
        if kernel_set is not candidates[-1]:
            logger.info(
                "CPU kernels: the %s set failed here (%s); trying the next one",
                kernel_set.name,
                _failures[kernel_set.name],
            )
    return _unavailable(_failures[candidates[0].name])


def _forced_set(kernel_set: KernelSet) -> CpuKernels | None:
    blocker = build_blocker()
    if blocker is not None:
        return _unavailable(blocker)
    lacking = missing_flags(kernel_set)
    if lacking:
        others = ", ".join(s.name for s in supported_sets()) or "none"
        return _unavailable(
            f"{ENV_SWITCH}={kernel_set.name} asks for the {kernel_set.description} kernels, but this CPU "
            f"lacks {', '.join(sorted(lacking))}; unset it, or name a set this CPU has ({others})"
        )
    kernels = _load(kernel_set)
    return kernels if kernels is not None else _unavailable(_failures[kernel_set.name])


def _load(kernel_set: KernelSet) -> CpuKernels | None:
    """The set's kernels, built (or found in the cache), loaded and self-checked once per process."""
    if kernel_set.name not in _loaded:
        kernels, failure = _build_and_check(kernel_set)
        _loaded[kernel_set.name] = kernels
        if failure is not None:
            _failures[kernel_set.name] = failure
    return _loaded[kernel_set.name]


def _build_and_check(kernel_set: KernelSet) -> tuple[CpuKernels | None, str | None]:
    blocker = build_blocker()
    if blocker is not None:
        return None, blocker
    try:
        path = _built_library(str(_compiler()), kernel_set)  # build_blocker found it
        kernels = CpuKernels(ctypes.CDLL(str(path)), path, kernel_set)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        sources = ", ".join(s.name for s in SOURCES)
        return None, f"building {sources} for {kernel_set.name} failed ({_first_line(error)})"
    problem = (
        kernels.int4_gemm.self_check()
        or kernels.int4_pack.self_check()
        or kernels.decode_attention.self_check()
        or kernels.elementwise.self_check()
    )
    if problem:
        return None, f"{problem} ({kernel_set.name} set)"
    logger.info(
        "CPU kernels: int4 GEMM, decode attention, RMSNorm, rotary and SiLU built for this CPU, "
        "kernel set %s (%s) (%s)",
        kernel_set.name,
        kernel_set.description,
        path,
    )
    return kernels, None


def _built_library(compiler: str, kernel_set: KernelSet) -> Path:
    key = _cache_key(compiler, kernel_set)
    directory = fitserve_cache_dir() / "cpu_kernels" / key
    path = directory / LIBRARY_NAME
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / path.name
        flags = (*kernel_set.compile_flags, *COMPILE_FLAGS)
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, path)  # atomic: a concurrent start sees a whole library or none
    return path


def _cache_key(compiler: str, kernel_set: KernelSet) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    digest = hashlib.sha256()
    parts = [source.read_bytes() for source in (*SOURCES, *sorted(Path(__file__).parent.glob("*.h")))]
    flags = " ".join((*kernel_set.compile_flags, *COMPILE_FLAGS)).encode()
    for part in (*parts, version.encode(), flags, _cpu_identity()):
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
    """Why the last load in this process gave no kernels (None: it gave them, or none ran)."""
    return _unavailable_reason


def _first_line(error: BaseException) -> str:
    stderr = getattr(error, "stderr", None)
    lines = (stderr or str(error)).strip().splitlines()
    errors = [line for line in lines if "error" in line]
    return (errors or lines or [type(error).__name__])[0]
