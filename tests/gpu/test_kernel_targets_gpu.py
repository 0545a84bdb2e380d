"""The cross-compile check of tests/unit/test_kernel_targets.py in the GPU suite (issue 35): every Triton
kernel variant fitserve launches compiles for sm_70, sm_75, sm_80, sm_86, sm_89 and sm_90 and fits that
GPU's shared memory and registers. It needs no GPU; here the six targets compile at once, one process
each, on the GPU machine's cores: the whole sweep (every head dim, GQA group, dtype, KV dtype, window)
with FITSERVE_KERNEL_TARGETS_FULL=1, else the representative subset.
  FITSERVE_KERNEL_TARGETS_FULL=1 python -m pytest -q tests/gpu/test_kernel_targets_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
TARGET_NAMES = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def test_every_variant_compiles_and_fits_on_every_target() -> None:
    full = os.environ.get("FITSERVE_KERNEL_TARGETS_FULL") == "1"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FITSERVE_KERNEL_TARGET")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fitserve.kernels.variants", *(["--full"] if full else [])]
    running = {
        name: subprocess.Popen(
            [*command, name], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name in TARGET_NAMES
    }
    failed, counts = [], {}
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=3600)
        assert process.returncode == 0, f"{name}: {stdout[-2000:]}{stderr[-3000:]}"
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        counts[name] = len(rows)
        for row in rows:
            if row["problems"]:
                options = ", ".join(f"{k}={v}" for k, v in row["options"].items() if k != "launch_pdl")
                failed.append(f"{name}: {row['kernel']}({options}) from {row['case']}: {row['problems']}")
    print("variants per target:", counts)
    assert not failed, f"{len(failed)} variants do not launch:\n" + "\n".join(failed)
