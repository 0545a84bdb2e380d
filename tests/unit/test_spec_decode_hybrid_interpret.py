"""A speculative verify step's DeltaNet rows through the Triton chain kernels (kernels/causal_conv1d.
causal_conv1d_chain, gated_delta_recurrent.fused_recurrent_gated_delta_rule_chain: their CUDA branch forced
on CPU tensors under Triton's CPU interpreter), against the same step on the torch path (depth by depth):
the step of tests/unit/test_spec_decode_hybrid.verify_step (two chains, one wrapping its ring, beside a
plain decode row and a prompt piece), its outputs and every pool row. float32, so only summation order
differs. Skipped where triton is not installed.

TRITON_INTERPRET must be set before triton is imported: the step runs in a child process (this file run as
a script, tests/unit/triton_interpreter.py), which returns one error figure per check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
TOLERANCE = 1e-4  # relative to max |reference|


@needs_triton
def test_verify_step_through_the_chain_kernels_matches_the_torch_path():
    found = run_in_interpreter(__file__, "all")
    assert set(found) == {"out", "conv", "state", "untouched"}
    for name, error in found.items():
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def _checks() -> dict[str, float]:
    from fitserve.layers import gated_delta_rule as ops
    from fitserve.models import delta_net_chain
    from tests.unit import test_spec_decode_hybrid as hybrid
    from tests.unit.qwen3_5_helpers import make_config

    config = make_config(moe=False, conditional=False)
    config.linear_key_head_dim, config.linear_value_head_dim = 16, 32  # the prompt piece's tl.dot
    torch_path = ops._use_kernels
    chained = delta_net_chain._chained_kernels
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return chained(*args, **kwargs)

    found = []
    for kernels in (False, True):
        step = hybrid.verify_step(config)
        before = step.pool.recurrent[0].clone()
        ops._use_kernels = (lambda t: True) if kernels else torch_path
        calls.clear()
        delta_net_chain._chained_kernels = counted
        try:
            out = hybrid.run_layer(step.layer, step.hidden, step.metadata)
        finally:
            ops._use_kernels = torch_path
            delta_net_chain._chained_kernels = chained
        assert bool(calls) == kernels, "the chain kernels ran exactly when forced"
        written = sorted(set(step.rows))
        untouched = [r for r in range(before.shape[0]) if r not in written]
        found.append((out, step.pool.conv[0].clone(), step.pool.recurrent[0].clone(), before, untouched))
    (want_out, want_conv, want_state, before, untouched), (out, conv, state, _, _) = found
    return {
        "out": _relative(out, want_out),
        "conv": _relative(conv, want_conv),
        "state": _relative(state, want_state),
        # rows no token of the step writes keep their states (0 when equal)
        "untouched": float((state[untouched] - before[untouched]).abs().max()),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    assert json.loads(sys.argv[1]) == "all"
    print(json.dumps(_checks()))
