"""The Gated DeltaNet layer's step path through the Triton kernels (their CUDA branches forced on CPU tensors
under Triton's CPU interpreter), against the same layer on the torch path: a step mixing decode rows and
prompt pieces (a chunk from its state, a fresh prompt, a one-token prompt at position 0: the row gathers and
the outputs written back into their rows), then a decode-only step with a padded row (slot -1), as a CUDA
graph replays it. float32, so only summation order differs. Skipped where triton is not installed.

TRITON_INTERPRET must be set before triton is imported: the layer runs in a child process (this file run as
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
def test_layer_steps_through_the_kernels_match_the_torch_path():
    found = run_in_interpreter(__file__, "all")
    names = {f"{step}/{what}" for step in ("mixed", "decode") for what in ("out", "conv", "state")}
    assert set(found) == names
    for name, error in found.items():
        assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def _checks() -> dict[str, float]:
    from fitserve.layers import gated_delta_rule as ops
    from fitserve.layers.attention.metadata import forward_context
    from tests.unit import test_qwen3_5_step_slots as steps

    config = steps.make_config(moe=False, conditional=False)
    config.linear_key_head_dim, config.linear_value_head_dim = 16, 32  # tl.dot needs dims of 16 or more
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(sum(steps.QUERY_LENS), config.hidden_size, generator=generator)
    decode_hidden = torch.randn(3, config.hidden_size, generator=generator)
    torch_path = ops._use_kernels
    found = []
    for kernels in (False, True):
        layer, pool = steps.make_layer(config)
        mixed = ops.DeltaNetStepSlots.build(steps.QUERY_LENS, steps.SEQ_LENS, steps.STEP_SLOTS, hidden.device)
        padded = ops.DeltaNetStepSlots.decode_only(torch.tensor([5, -1, 1], dtype=torch.int32))
        ops._use_kernels = (lambda t: True) if kernels else torch_path
        try:
            results = []
            runs = (
                (mixed, hidden, steps.QUERY_LENS, steps.SEQ_LENS),
                (padded, decode_hidden, [1] * 3, [9] * 3),
            )
            for step, rows, query_lens, seq_lens in runs:
                metadata = steps.metadata_for(query_lens, seq_lens, None, step)
                with torch.no_grad(), forward_context(metadata, []):
                    out = layer(rows)
                results.append((out, pool.conv[0].clone(), pool.recurrent[0].clone()))
        finally:
            ops._use_kernels = torch_path
        found.append(results)
    errors = {}
    for name, want, got in zip(("mixed", "decode"), found[0], found[1]):
        for what, w, g in zip(("out", "conv", "state"), want, got):
            errors[f"{name}/{what}"] = _relative(g, w)
    return errors


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    assert json.loads(sys.argv[1]) == "all"
    print(json.dumps(_checks()))
