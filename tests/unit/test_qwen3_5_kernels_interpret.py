"""Qwen3.5/3.6's fused kernels under Triton's CPU interpreter at tiny shapes, against the torch path of
fitserve/models/qwen3_5_layers.py and qwen3_5_delta_net.py they replace, built from its own modules:
- kernels/gated_rms_norm.py: GatedDeltaNet's `norm(core.to(dtype), z)` (GatedRMSNorm), core in float32
  and already in the dtype, the gate a view of in_proj_z's [T, H * D] rows, given as [T, H, D] and as is;
- kernels/qk_norm_partial_rope.py: Qwen3_5Attention's `rope.rotate(q_norm(query))` and k's, query from a
  strided [T, H, 2D] view of a packed projection, rotary dims a quarter of the head (Qwen3.5's) and all
  of it;
- kernels/activation.py's sigmoid_gate_mul: `out * torch.sigmoid(gate.reshape(tokens, -1))`.
In float16 and bfloat16 each must equal the torch path exactly (same roundings, in the same order); in
float32 to 1e-6 relative (summation order). Exact holds at these shapes; over a few hundred tokens of 48
heads a few values in a million come out one ulp apart, from no rounding of the kernels': the norms' sum of
squares adds in numpy's order here, torch's vectorised one there, and silu's exp is numpy's here, Sleef's
in torch (on CUDA the kernels take expf as torch does; kernels/activation.py's exp_as_torch). Each runs
with the modules' default tile in every dtype, and with a tile of two heads in bfloat16, so a token takes
several programs and the last head block is partly masked. Skipped where triton is not installed (CI
installs only torch).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in one child process (this file
run as a script, tests/unit/triton_interpreter.py); it returns one error figure per check: max |got - want|
in float16 / bfloat16, max |got - want| over max |want| in float32.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.unit.triton_interpreter import check_errors, run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

FLOAT32 = 1e-6  # relative: the sum of squares in another order
DTYPES = ("float16", "bfloat16", "float32")
EPS = 1e-6


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return run_in_interpreter(__file__, "all")


def _check(errors: dict[str, float], kernel: str) -> None:
    for dtype in ("float16", "bfloat16"):
        check_errors(errors, f"{kernel}/{dtype}/", 0.0)  # exact: the torch path's roundings
    check_errors(errors, f"{kernel}/float32/", FLOAT32)


@needs_triton
def test_gated_rms_norm_equals_the_torch_path(errors: dict[str, float]) -> None:
    _check(errors, "gated")


@needs_triton
def test_qk_norm_partial_rope_equals_the_torch_path(errors: dict[str, float]) -> None:
    _check(errors, "qk")


@needs_triton
def test_sigmoid_gate_mul_equals_the_torch_path(errors: dict[str, float]) -> None:
    _check(errors, "sigmoid_gate")


@needs_triton
def test_gated_rms_norm_refuses_bad_inputs() -> None:
    from fitserve.kernels.gated_rms_norm import gated_rms_norm

    core, gate, weight = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.ones(8)
    bf16 = torch.bfloat16
    with pytest.raises(ValueError, match=r"core \[T, H, D\] .* got core \(2, 24\)"):
        gated_rms_norm(torch.zeros(2, 24), gate, weight, EPS, torch.float32)
    with pytest.raises(ValueError, match=r"core \(2, 3, 8\) \(strides \(24, 1, 3\)\)"):
        gated_rms_norm(torch.zeros(2, 8, 3).transpose(1, 2), gate, weight, EPS, torch.float32)
    with pytest.raises(ValueError, match=r"gate \[T, H, D\] = \(2, 3, 8\) or \[T, H \* D\] = \(2, 24\) .* "):
        gated_rms_norm(core, torch.zeros(2, 3, 4), weight, EPS, torch.float32)
    with pytest.raises(ValueError, match=r"gate's last dim contiguous; got gate \(2, 3, 8\) with strides"):
        gated_rms_norm(core, torch.zeros(2, 8, 3).transpose(1, 2), weight, EPS, torch.float32)
    with pytest.raises(ValueError, match=r"weight \[D\] = \[8\] .* got weight \(4,\)"):
        gated_rms_norm(core, gate, torch.ones(4), EPS, torch.float32)
    with pytest.raises(ValueError, match="core in float32 or torch.bfloat16 .* gate torch.float32"):
        gated_rms_norm(core, gate, weight.to(bf16), EPS, bf16)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32; got dtype torch.float64"):
        gated_rms_norm(core, gate, weight, EPS, torch.float64)
    empty = gated_rms_norm(torch.zeros(0, 3, 8), torch.zeros(0, 24, dtype=bf16), weight.to(bf16), EPS, bf16)
    assert empty.shape == (0, 24) and empty.dtype == bf16


@needs_triton
def test_qk_norm_partial_rope_refuses_bad_inputs() -> None:
    from fitserve.kernels.qk_norm_partial_rope import qk_norm_partial_rope

    query_gate, k, weight = torch.zeros(2, 3, 16), torch.zeros(2, 1, 8), torch.zeros(8)
    cos = sin = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"got query_gate \(2, 3, 8\) and k \(2, 1, 8\)"):
        qk_norm_partial_rope(torch.zeros(2, 3, 8), k, weight, weight, EPS, cos, sin)
    with pytest.raises(ValueError, match=r"one token count .* k \(3, 1, 8\)"):
        qk_norm_partial_rope(query_gate, torch.zeros(3, 1, 8), weight, weight, EPS, cos, sin)
    with pytest.raises(ValueError, match=r"query_gate torch.float32, k torch.bfloat16"):
        qk_norm_partial_rope(query_gate, k.to(torch.bfloat16), weight, weight, EPS, cos, sin)
    with pytest.raises(ValueError, match=r"q_weight and k_weight \[D\] = \[8\] .* got \[\(\(16,\)"):
        qk_norm_partial_rope(query_gate, k, torch.zeros(16), weight, EPS, cos, sin)
    with pytest.raises(ValueError, match=r"R even and at most head_dim 8; got cos \(2, 3\)"):
        qk_norm_partial_rope(query_gate, k, weight, weight, EPS, torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"at most head_dim 8; got cos \(2, 10\)"):
        qk_norm_partial_rope(query_gate, k, weight, weight, EPS, torch.zeros(2, 10), torch.zeros(2, 10))
    with pytest.raises(ValueError, match=r"cos and sin in torch.float32 .* got cos torch.bfloat16"):
        qk_norm_partial_rope(query_gate, k, weight, weight, EPS, cos.to(torch.bfloat16), sin)
    q, k_out = qk_norm_partial_rope(
        torch.zeros(0, 3, 16), torch.zeros(0, 1, 8), weight, weight, EPS, torch.zeros(0, 4), torch.zeros(0, 4)
    )
    assert q.shape == (0, 3, 8) and k_out.shape == (0, 1, 8)


@needs_triton
def test_sigmoid_gate_mul_refuses_bad_inputs() -> None:
    from fitserve.kernels.activation import sigmoid_gate_mul

    query_gate = torch.zeros(2, 3, 16)
    with pytest.raises(ValueError, match=r"query_gate \[T, H, 2 \* D\] .* got query_gate \(2, 3, 15\)"):
        sigmoid_gate_mul(torch.zeros(2, 21), torch.zeros(2, 3, 15))
    with pytest.raises(ValueError, match=r"x \[T, H \* D\] = \(2, 24\) .* got x \(2, 3, 8\)"):
        sigmoid_gate_mul(torch.zeros(2, 3, 8), query_gate)
    with pytest.raises(ValueError, match=r"got x torch.float16, query_gate torch.float32"):
        sigmoid_gate_mul(torch.zeros(2, 24, dtype=torch.float16), query_gate)
    assert sigmoid_gate_mul(torch.zeros(0, 24), torch.zeros(0, 3, 16)).shape == (0, 24)


# --- the child process ------------------------------------------------------------------------------


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert got.is_contiguous()
    diff = float((got.float() - want.float()).abs().max())
    if want.dtype != torch.float32:
        return diff
    return diff / float(want.float().abs().max().clamp_min(1e-30))


def _tiles(module: Any) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Sets module.HEAD_TILE to its default, then to a tile of two heads of 32 (several programs a token,
    the last partly masked for 3 heads), yielding (label, dtypes) for each: every dtype at the default,
    bfloat16 at the small tile (the interpreter is slow). The default is put back afterwards."""
    default = module.HEAD_TILE
    try:
        for label, tile, names in (("tile_default", default, DTYPES), ("tile_two_heads", 64, ("bfloat16",))):
            module.HEAD_TILE = tile
            yield label, names
    finally:
        module.HEAD_TILE = default


def _gated_checks(results: dict[str, float]) -> None:
    from fitserve.kernels import gated_rms_norm as module
    from fitserve.models.qwen3_5_delta_net import GatedRMSNorm

    generator = torch.Generator().manual_seed(0)
    for tile_label, names in _tiles(module):
        for name in names:
            dtype = getattr(torch, name)
            for tokens, heads, head_dim in ((1, 3, 32), (5, 3, 32), (5, 4, 16)):
                label = f"gated/{name}/{tile_label}/{tokens}x{heads}x{head_dim}"
                core = 3 * torch.randn(tokens, heads, head_dim, generator=generator)
                # in_proj_z's rows inside a wider buffer: a [T, H * D] view with a longer row stride
                z_rows = (2 * torch.randn(tokens, heads * head_dim + 8, generator=generator)).to(dtype)
                z = z_rows[:, : heads * head_dim]
                norm = GatedRMSNorm(head_dim, EPS)
                norm.weight.data = (0.5 * torch.randn(head_dim, generator=generator)).to(dtype)
                want = norm(core.to(dtype), z.view(tokens, heads, head_dim)).reshape(tokens, -1)
                results[f"{label}/gate_3d"] = _error(
                    module.gated_rms_norm(core, z.view(tokens, heads, head_dim), norm.weight, EPS, dtype),
                    want,
                )
                results[f"{label}/gate_2d"] = _error(
                    module.gated_rms_norm(core, z, norm.weight, EPS, dtype), want
                )
                # the core already in the dtype
                core_d = core.to(dtype)
                results[f"{label}/core_in_dtype"] = _error(
                    module.gated_rms_norm(core_d, z, norm.weight, EPS, dtype),
                    norm(core_d, z.view_as(core_d)).reshape(tokens, -1),
                )


def _qk_checks(results: dict[str, float]) -> None:
    from fitserve.kernels import qk_norm_partial_rope as module
    from fitserve.models.qwen3_5_layers import PartialRope, Qwen3_5RMSNorm, rope_inv_freq

    generator = torch.Generator().manual_seed(1)
    for tile_label, names in _tiles(module):
        for name in names:
            dtype = getattr(torch, name)
            for tokens, heads, kv_heads, head_dim, factor in (
                (1, 3, 2, 32, 0.25),
                (5, 3, 2, 32, 0.25),
                (5, 3, 2, 32, 1.0),
                (5, 3, 1, 16, 0.25),
            ):
                rotary_dim = int(head_dim * factor)
                label = f"qk/{name}/{tile_label}/{tokens}x{heads}x{kv_heads}x{head_dim}/rotary{rotary_dim}"
                config = SimpleNamespace(
                    head_dim=head_dim,
                    rope_parameters={
                        "rope_type": "default",
                        "partial_rotary_factor": factor,
                        "rope_theta": 1e7,
                    },
                )
                positions = torch.randint(0, 5000, (tokens,), generator=generator)
                rope = PartialRope(positions, rope_inv_freq(config), dtype)
                assert rope.rotary_dim == rotary_dim
                # q_proj's and k_proj's outputs inside one packed buffer: strided views
                q_width, k_width = heads * 2 * head_dim, kv_heads * head_dim
                packed = (4 * torch.randn(tokens, q_width + k_width + 8, generator=generator)).to(dtype)
                query_gate = packed[:, :q_width].view(tokens, heads, 2 * head_dim)
                k = packed[:, q_width : q_width + k_width].view(tokens, kv_heads, head_dim)
                q_norm, k_norm = Qwen3_5RMSNorm(head_dim, EPS), Qwen3_5RMSNorm(head_dim, EPS)
                q_norm.weight.data = (0.5 * torch.randn(head_dim, generator=generator)).to(dtype)
                k_norm.weight.data = (0.5 * torch.randn(head_dim, generator=generator)).to(dtype)
                want_q = rope.rotate(q_norm(query_gate[..., :head_dim])).contiguous()
                want_k = rope.rotate(k_norm(k)).contiguous()
                got_q, got_k = module.qk_norm_partial_rope(
                    query_gate, k, q_norm.weight, k_norm.weight, EPS, rope.cos[:, 0], rope.sin[:, 0]
                )
                results[f"{label}/q"] = _error(got_q, want_q)
                results[f"{label}/k"] = _error(got_k, want_k)


def _sigmoid_gate_checks(results: dict[str, float]) -> None:
    from fitserve.kernels import activation as module

    generator = torch.Generator().manual_seed(2)
    for tile_label, names in _tiles(module):
        for name in names:
            dtype = getattr(torch, name)
            for tokens, heads, head_dim in ((1, 3, 32), (5, 3, 32), (5, 4, 16)):
                label = f"sigmoid_gate/{name}/{tile_label}/{tokens}x{heads}x{head_dim}"
                packed = (4 * torch.randn(tokens, heads * 2 * head_dim + 8, generator=generator)).to(dtype)
                query_gate = packed[:, : heads * 2 * head_dim].view(tokens, heads, 2 * head_dim)
                out = torch.randn(tokens, heads * head_dim, generator=generator).to(dtype)
                want = out * torch.sigmoid(query_gate[..., head_dim:].reshape(tokens, -1))
                results[label] = _error(module.sigmoid_gate_mul(out, query_gate), want)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    assert json.loads(sys.argv[1]) == "all"
    found: dict[str, float] = {}
    for checks in (_gated_checks, _qk_checks, _sigmoid_gate_checks):
        checks(found)
    print(json.dumps(found))
