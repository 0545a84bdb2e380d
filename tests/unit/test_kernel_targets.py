"""Every Triton kernel variant fitserve launches compiles for sm_70, sm_75, sm_80, sm_86, sm_89 and sm_90 and
fits that GPU's shared memory and registers (issue 35). No GPU needed: kernels/variants.py runs the launchers
on CPU tensors with the capability forced and compiles instead of launching (Triton's bundled ptxas 12.8).

The default run compiles the representative subset (the auto-fit dtype, head dims 80 / 128 / 256 / 512, the
config choosers' thresholds) for the two tightest targets: sm_75 (64 KB of shared memory a block, no cp.async)
and sm_86 (99 KB, with cp.async stages). An attention variant takes 10 to 60 s to compile on a busy 2-core
machine, so that is several minutes (Triton's cache makes reruns fast). FITSERVE_KERNEL_TARGETS=all (or a
comma-separated list) adds targets; FITSERVE_KERNEL_TARGETS_FULL=1 runs the whole sweep (every head dim, GQA
group, dtype, KV dtype and window). tests/gpu/test_kernel_targets_gpu.py runs all six targets at once on the
GPU machine's cores. Each target compiles in a child process: the harness swaps Triton's driver and
torch.cuda's device queries while it runs. The four kernels that touch a float8 e4m3 KV cache compile for
sm_70 to sm_89 at one shape each (the attention kernels take the cache as its bytes, the writes below 8.9
too: kernels/fp8_bits.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALL_TARGETS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
_CHOSEN = os.environ.get("FITSERVE_KERNEL_TARGETS", "sm_75,sm_86")
TARGET_NAMES = ALL_TARGETS if _CHOSEN == "all" else tuple(name.strip() for name in _CHOSEN.split(","))
FULL = os.environ.get("FITSERVE_KERNEL_TARGETS_FULL") == "1"

pytest.importorskip("triton")


def compile_target(name: str, full: bool, cases: tuple[str, ...] = ()) -> list[dict]:
    """The JSON rows of `python -m fitserve.kernels.variants` for one target."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("FITSERVE_KERNEL_TARGET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fitserve.kernels.variants", *(["--full"] if full else []), name, *cases]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def describe(row: dict) -> str:
    options = ", ".join(f"{k}={v}" for k, v in row["options"].items() if k not in ("launch_pdl", "error"))
    where = f"[{row.get('signature', '')}] from {row['case']}"
    return f"{row['kernel']}({options}) {where}: {'; '.join(row['problems'])}"


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_variant_compiles_and_fits(name: str) -> None:
    rows = compile_target(name, FULL)
    failed = [describe(row) for row in rows if row["problems"]]
    assert not failed, f"{len(failed)} of {len(rows)} variants do not launch on {name}:\n" + "\n".join(failed)
    kernels = {row["kernel"] for row in rows}
    # every launch case reached its kernels (a case that stopped early would hide the rest)
    for kernel in (
        "_decode_partition_kernel",
        "_prefill_kernel",
        "_rms_norm_kernel",
        "_int4_gemv_kernel",
        "_one_shot_all_reduce_kernel",
        "_one_shot_all_reduce_norm_kernel",
    ):
        assert kernel in kernels, f"{kernel} was not compiled for {name}: {sorted(kernels)}"
    pdl = {row["options"].get("USE_PDL") for row in rows if "USE_PDL" in row["options"]}
    assert pdl == ({True} if name == "sm_90" else {False}), f"USE_PDL on {name}: {pdl}"


# The kernels that touch the KV cache (they take a float8 e4m3 cache as its bytes, the writes only below
# 8.9), and which of the argument types in their compiled signature is the cache pointer's
CACHE_ARGUMENT = {
    "_reshape_and_cache_kernel": 2,
    "_rotary_cache_write_kernel": 5,
    "_decode_partition_kernel": 1,
    "_prefill_kernel": 1,
}


@pytest.mark.parametrize("name", ["sm_70", "sm_75", "sm_80", "sm_86", "sm_89"])
def test_e4m3_cache_kernels_compile_from_the_bytes(name: str) -> None:
    """Issues 35, 32: below 8.9 Triton has no e4m3 conversion, so the launchers pass the cache as uint8 and
    the kernels decode it in integer operations (kernels/fp8_bits.py); from 8.9 on the cache goes as its
    bytes beside bfloat16 queries too (the subset's dtype there), decoded off the conversion unit
    (tests/unit/test_e4m3_kv_sass.py)."""
    rows = compile_target(name, False, ("e4m3_kv_cache",))
    failed = [describe(row) for row in rows if row["problems"]]
    assert not failed, f"e4m3 cache variants do not launch on {name}:\n" + "\n".join(failed)
    cache_types = {
        row["kernel"]: row["signature"].split(", ")[CACHE_ARGUMENT[row["kernel"]]]
        for row in rows
        if row["kernel"] in CACHE_ARGUMENT
    }
    assert set(cache_types) == set(CACHE_ARGUMENT), sorted(cache_types)
    # the writes encode with Triton's conversion from 8.9 on; the attention kernels read the bytes
    writes = "*fp8e4nv" if name == "sm_89" else "*u8"
    expected = {kernel: writes if "cache" in kernel else "*u8" for kernel in CACHE_ARGUMENT}
    assert cache_types == expected, cache_types


def test_the_check_catches_a_variant_that_does_not_fit() -> None:
    from fitserve.kernels import variants

    t4, h100 = variants.TARGETS_BY_NAME["sm_75"], variants.TARGETS_BY_NAME["sm_90"]
    big = variants.Usage(shared=140 * 1024, registers=96, local=0, num_warps=4)
    assert variants.launch_problems(big, h100) == []
    assert "shared memory 143360 B > 65536 B" in variants.launch_problems(big, t4)[0]
    # 255 registers x 8 warps: 65536 registers, exactly an SM's; 16 warps of 129 (136 allocated) do not fit
    assert variants.launch_problems(variants.Usage(0, 255, 0, 8), t4) == []
    assert "registers" in variants.launch_problems(variants.Usage(0, 129, 0, 16), t4)[0]


def test_configs_follow_the_gpus_shared_memory_and_the_cache_element_size() -> None:
    from fitserve.kernels import capability, decode_attention, prefill_attention

    assert capability.parse_target("sm75") == capability.parse_target("sm_75") == (7, 5)
    assert capability.parse_target("7.5") == (7, 5) and capability.parse_target("sm_120") == (12, 0)
    with pytest.raises(ValueError, match="FITSERVE_KERNEL_TARGET"):
        capability.parse_target("turing")
    import torch

    cpu = torch.device("cpu")
    assert capability.kernel_capability(cpu) is None
    with capability.forced_target((7, 5)):
        assert capability.kernel_capability(cpu) == (7, 5)
        assert capability.shared_memory_per_block((7, 5)) == 64 * 1024
    assert capability.shared_memory_per_block((8, 7)) == 163 * 1024
    assert capability.shared_memory_per_block((12, 0)) == 99 * 1024
    h100 = capability.SHARED_MEMORY_PER_BLOCK[(9, 0)]
    assert decode_attention.choose_config(8, 8, 1, 132, 128, h100) is decode_attention.WHOLE_CONTEXT_CONFIG
    t4 = capability.SHARED_MEMORY_PER_BLOCK[(7, 5)]
    assert decode_attention.choose_config(8, 8, 1, 40, 128, t4) is decode_attention.DEFAULT_DECODE_CONFIG
    # a float8 cache (a byte an element) takes the whole-context tiles at any batch of one partition
    whole, default = decode_attention.WHOLE_CONTEXT_CONFIG, decode_attention.DEFAULT_DECODE_CONFIG
    assert decode_attention.choose_config(256, 8, 1, 132, 128, h100) is default  # 2,048 programs
    assert decode_attention.choose_config(256, 8, 1, 132, 128, h100, 1) is whole
    assert decode_attention.choose_config(1, 8, 16, 132, 128, h100, 1) is default  # split-K
    assert decode_attention.choose_config(256, 8, 1, 40, 128, t4, 1) is default  # 64 KB a block
    a100 = capability.SHARED_MEMORY_PER_BLOCK[(8, 0)]
    assert decode_attention.choose_config(27, 8, 1, 108, 128, a100, 1) is whole  # 2 an SM, as 16-bit
    assert decode_attention.choose_config(256, 8, 1, 108, 128, a100, 1) is default  # Hopper only
    # and long queries over it take 128 x 128 tiles on Hopper (the 16-bit long-query tile spills there)
    choose_prefill = prefill_attention.choose_prefill_config
    assert choose_prefill(8192, 1, 128, h100, True, 1) is prefill_attention.FLOAT8_LONG_QUERY_CONFIG
    assert choose_prefill(8192, 1, 128, h100) is prefill_attention.LONG_QUERY_CONFIG
    assert choose_prefill(8192, 1, 128, a100, True, 1) is prefill_attention.LONG_QUERY_CONFIG
    assert choose_prefill(100, 10, 128, h100, True, 1) is prefill_attention.DEFAULT_PREFILL_CONFIG


def test_forced_target_from_the_environment() -> None:
    code = (
        "import torch; from fitserve.kernels import capability, dependent_launch as d;"
        "print(capability.kernel_capability(torch.device('cpu')), d.pdl_kwargs(torch.device('cpu')))"
    )
    for value, expected in (("sm75", "(7, 5) {'USE_PDL': False"), ("sm_90", "(9, 0) {'USE_PDL': True")):
        env = dict(os.environ, FITSERVE_KERNEL_TARGET=value, PYTHONPATH=str(REPO))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith(expected), done.stdout


@pytest.mark.parametrize("target", ["sm_75", "sm_86", "sm_90"])
def test_int4_and_prefill_tiles_fit_each_gpu_and_the_h100_keeps_its_own(target: str) -> None:
    from fitserve.kernels import capability, int4_gemm, prefill_attention

    cap = capability.parse_target(target)
    shared = capability.shared_memory_per_block(cap)
    for rows in (1, 16, 32, 64, 128, 512, 4096):
        config = int4_gemm.choose_config(rows, 4096, 4096, 132, shared)
        assert config.kernel == "gemv" or int4_gemm.dot_shared_bytes(config) <= shared, (target, rows, config)
        if target == "sm_90":
            assert config == int4_gemm.choose_config(rows, 4096, 4096, 132), rows
    for head_dim in (64, 128, 256, 512):
        for tokens, seqs in ((64, 8), (4096, 1)):
            config = prefill_attention.choose_prefill_config(tokens, seqs, head_dim, shared, cap >= (8, 0))
            if cap < (8, 0):
                block_n = config.block_n if head_dim <= 128 else min(config.block_n, 32)
                assert prefill_attention.fma_dot_shared_bytes(config.block_m, block_n, head_dim) <= shared
            if target == "sm_90":
                assert config is prefill_attention.choose_prefill_config(tokens, seqs, head_dim)


def test_chunked_gated_delta_kernel_refuses_gpus_below_sm80() -> None:
    import torch

    from fitserve.kernels import capability, gated_delta_chunk

    cpu = torch.device("cpu")
    assert gated_delta_chunk.runs_on(cpu)  # the interpreter's
    with capability.forced_target((8, 6)):
        assert gated_delta_chunk.runs_on(cpu)
        assert gated_delta_chunk.default_block_v(128, capability.shared_memory_per_block((8, 6))) == 32
    assert gated_delta_chunk.default_block_v(128, capability.SHARED_MEMORY_PER_BLOCK[(9, 0)]) == 64
    with capability.forced_target((7, 5)):
        assert not gated_delta_chunk.runs_on(cpu)
        q = torch.zeros(4, 2, 128)
        with pytest.raises(ValueError, match="needs compute capability 8.0 .* 7.5 GPU"):
            gated_delta_chunk.chunk_gated_delta_rule_kernel(
                q,
                q,
                torch.zeros(4, 4, 128),
                torch.zeros(4, 4),
                torch.zeros(4, 4),
                torch.zeros(1, 4, 128, 128),
                [4],
                [0],
                [False],
            )


def test_compiling_leaves_every_launcher_as_it_was() -> None:
    """compile_variants stands in for the launchers' `supports` and `sm_count` while it runs; afterwards each
    module has its own again, one first imported inside it included (skinny_split_gemm imports skinny_gemm's
    `supports` by name: imported after skinny_gemm was patched, it kept the stand-in, and every later call
    on a CPU tensor went to the kernel). In a fresh process, so nothing is imported before."""
    code = (
        "from fitserve.kernels import capability, variants\n"
        "target = variants.TARGETS_BY_NAME['sm_86']\n"
        "list(variants.compile_variants(target, cases={'none': lambda target, full: None}))\n"
        "from fitserve.kernels import skinny_gemm, skinny_split_gemm\n"
        "assert skinny_split_gemm.supports is skinny_gemm.supports, skinny_split_gemm.supports\n"
        "assert skinny_split_gemm.sm_count is capability.sm_count, skinny_split_gemm.sm_count\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_int4_rows_up_to_8_take_the_mma_kernel_where_it_runs() -> None:
    from fitserve.kernels import int4_gemm

    for rows in (1, 5, 8):
        config = int4_gemm.choose_config(rows, 4096, 14336, 132, mma=True)
        assert (config.kernel, config.block_m, config.block_n, config.split_k) == ("mma", 8, 64, 8), config
    assert int4_gemm.choose_config(9, 4096, 4096, 132, mma=True).kernel == "dot"
    assert int4_gemm.choose_config(1, 4096, 4096, 132, mma=False).kernel == "gemv"
    # gate_up's 448 tiles of 64 rows already give 3.4 programs an SM: no split
    assert int4_gemm.choose_config(1, 28672, 4096, 132, mma=True).split_k == 1
