"""What tests/unit/test_int4_*_interpret.py share: random canonical int4 weights, and patches for three gaps
of Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) for their child processes (which have the repository
root on PYTHONPATH). Call patch_interpreter() after importing triton, before any kernel runs:
- loop bounds computed inside a kernel are numpy scalars that numpy 2.4 no longer turns into Python ints
  (tensors get an __index__);
- a bfloat16 tl.dot multiplies the raw uint16 storage as integers (widen both sides to float32 first);
- float32 -> bfloat16 casts truncate instead of rounding to nearest even (round through torch).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def run_in_interpreter(script: str, request: Any) -> Any:
    """Runs `script` (a test file whose __main__ block answers `request`, given as JSON in argv) in a child
    process with TRITON_INTERPRET=1; returns the JSON of its last output line. Skips the calling test (or
    fixture) where triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, script, json.dumps(request)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def answer_cases(run_case: Any) -> None:
    """The __main__ block of a test file run by run_in_interpreter whose request is a list of cases:
    patches the interpreter, prints [run_case(case) for each case] as JSON."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    patch_interpreter()
    print(json.dumps([run_case(case) for case in json.loads(sys.argv[1])]))


def random_int4(
    out_features: int, in_features: int, group_size: int, seed: int = 0, integer_zeros: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical int4 (codes uint8 [N, K], scales and zero points [N, K // group_size]) on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
    scales = 0.005 + 0.02 * torch.rand(out_features, groups, generator=generator)
    zeros = torch.randint(0, 16, (out_features, groups), generator=generator).float()
    if not integer_zeros:
        zeros += torch.rand(out_features, groups, generator=generator)
    return codes, scales, zeros


def patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def with_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = with_index

    def widened(handle):
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def dot_in_float32(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype, b.dtype):
            a, b = widened(a), widened(b)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = dot_in_float32
    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def cast_to_nearest(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(values.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_to_nearest


def check_errors(errors: dict[str, float], prefix: str, tolerance: float) -> None:
    """Every error whose name starts with `prefix` (there must be some) is at most `tolerance`."""
    checked = {name: value for name, value in errors.items() if name.startswith(prefix)}
    assert checked, prefix
    failed = {name: value for name, value in checked.items() if not value <= tolerance}
    assert not failed, failed


def case_result(case: dict, out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> dict:
    """What a kernel test's run_case answers: its case, the largest error relative to the reference's
    largest value, whether the output is finite, its largest value, and its shape and dtype (x's)."""
    scale = ref.float().abs().max().item() or 1.0
    return {
        "case": case,
        "error": (out.float() - ref.float()).abs().max().item() / scale,
        "finite": bool(torch.isfinite(out.float()).all()),
        "max_abs": out.float().abs().max().item(),
        "shape_dtype_ok": out.shape == x.shape and out.dtype == x.dtype,
    }


def assert_case_matches(result: dict, case: dict, tolerance: float) -> None:
    """case_result's answer for `case`: finite, of x's shape and dtype, not all zero, within tolerance."""
    assert result["case"] == case
    assert result["finite"] and result["shape_dtype_ok"], result
    assert result["max_abs"] > 0.0, result
    assert result["error"] <= tolerance, result
