"""Gemma-4's Triton kernels under Triton's CPU interpreter at tiny shapes, against the torch path they
replace on CUDA (fitserve/models/gemma4_layers.py's CPU forward): the Gemma RMSNorm with and without a
weight (on a strided per-head view too), the fused `residual + norm(x)` with layer_scalar and the next
norm, gelu(tanh)-and-mul (packed and apart), and the rotary + q/k norm + cache-write kernel at head dims
256 and 512 with Gemma-4's partial ("proportional") rotation, split over heads, plus its q-only form.
Skipped where triton is not installed (CI installs only torch).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in one child process (this file
run as a script, tests/unit/triton_interpreter.py); it returns one error figure per check (max |got - want|
over max |want|) and the tests compare them with the tolerances.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from fitserve.layers.rotary_embedding import RopeSettings, RotaryEmbedding, StepRope
from fitserve.models.gemma4 import _table_rope, gemma4_inv_freq
from tests.unit.triton_interpreter import check_errors, run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

FLOAT32 = 1e-5  # summation order and rsqrt against pow(., -0.5)
BF16 = 2**-7  # one bfloat16 rounding apart, here and there (relative to max |want|)
# the fused q/k norm rounds the normalised head before the weight (kernels/norm.py's order), torch after
FUSED_NORM_BF16 = 2**-6
FULL_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
SLIDING_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}
MAX_POSITIONS = 64


def gemma_rotary(rope: dict, head_dim: int) -> RotaryEmbedding:
    """The RotaryEmbedding Gemma4Model builds for a layer type."""
    rotary = RotaryEmbedding(head_dim, RopeSettings(), MAX_POSITIONS)
    rotary.inv_freq = gemma4_inv_freq(rope, head_dim)
    return rotary


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return run_in_interpreter(__file__, "all")


@needs_triton
def test_gemma_rms_norm(errors: dict[str, float]) -> None:
    check_errors(errors, "norm/float32", FLOAT32)
    check_errors(errors, "norm/bfloat16", BF16)


@needs_triton
def test_norm_add_with_layer_scalar_and_next_norm(errors: dict[str, float]) -> None:
    check_errors(errors, "norm_add/float32", FLOAT32)
    check_errors(errors, "norm_add/bfloat16", BF16)


@needs_triton
def test_gelu_tanh_and_mul(errors: dict[str, float]) -> None:
    check_errors(errors, "gelu/float32", FLOAT32)
    check_errors(errors, "gelu/bfloat16", BF16)


@needs_triton
def test_rotary_cache_write_at_gemma_head_dims(errors: dict[str, float]) -> None:
    check_errors(errors, "rotary/float32", FLOAT32)
    check_errors(errors, "rotary/bfloat16", FUSED_NORM_BF16)
    assert errors["rotary/padding_untouched"] == 0.0  # a slot of -1 writes nothing


@needs_triton
def test_q_only_norm_and_rotation(errors: dict[str, float]) -> None:
    check_errors(errors, "q_only/float32", FLOAT32)
    check_errors(errors, "q_only/bfloat16/256/normed", FUSED_NORM_BF16)
    check_errors(errors, "q_only/bfloat16/512/normed", FUSED_NORM_BF16)
    check_errors(errors, "q_only/bfloat16/256/plain", BF16)
    check_errors(errors, "q_only/bfloat16/512/plain", BF16)


@pytest.mark.parametrize(("rope", "head_dim"), [(SLIDING_ROPE, 256), (FULL_ROPE, 512)])
def test_cos_sin_table_is_the_cpu_tables(rope: dict, head_dim: int) -> None:
    """The table the CUDA path reads holds, row by row, the cos and sin the CPU path computes (both
    rounded to the model dtype as HF rounds them); the proportional layers' unrotated pairs hold cos 1
    and sin 0, so a whole-head rotation leaves those dims as they are."""
    rotary = gemma_rotary(rope, head_dim)
    table = rotary.cos_sin_table(torch.device("cpu"), torch.bfloat16)
    positions = torch.arange(MAX_POSITIONS)
    cos, sin = rotary(positions, torch.bfloat16)
    half = head_dim // 2
    assert table.shape == (MAX_POSITIONS, head_dim) and table.dtype == torch.bfloat16
    assert torch.equal(table[:, :half], cos[:, :half]) and torch.equal(table[:, half:], sin[:, :half])
    rotated = int(rope.get("partial_rotary_factor", 1.0) * half)
    assert torch.all(table[:, rotated:half] == 1) and torch.all(table[:, half + rotated :] == 0)
    assert not torch.all(table[1:, :rotated] == 1)  # the rotated pairs do rotate
    assert rotary.cos_sin_table(torch.device("cpu"), torch.bfloat16) is table  # built once


# --- the child process ------------------------------------------------------------------------------


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _torch_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    from fitserve.models.gemma4_layers import GemmaRMSNorm

    norm = GemmaRMSNorm(x.shape[-1], eps, with_scale=weight is not None)
    if weight is not None:
        norm.weight.data = weight
    return norm(x)  # the CPU path: x is on the CPU


def _norm_checks(results: dict[str, float]) -> None:
    from fitserve.kernels.norm import gemma_norm_add, gemma_rms_norm

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        x = (3 * torch.randn(5, 96, generator=generator)).to(dtype)
        weight = (1 + torch.randn(96, generator=generator)).to(dtype)
        results[f"norm/{name}/weight"] = relative(
            gemma_rms_norm(x, weight, 1e-6), _torch_norm(x, weight, 1e-6)
        )
        results[f"norm/{name}/no_weight"] = relative(
            gemma_rms_norm(x, None, 1e-6), _torch_norm(x, None, 1e-6)
        )
        # per head of a packed qkv row: [T, heads, head_dim] with a row stride wider than the heads
        packed = torch.randn(3, 4 * 32 + 16, generator=generator).to(dtype)
        heads = packed[:, :128].view(3, 4, 32)
        head_weight = torch.randn(32, generator=generator).to(dtype)
        got = gemma_rms_norm(heads, head_weight, 1e-6)
        results[f"norm/{name}/strided_heads"] = relative(got, _torch_norm(heads, head_weight, 1e-6))

        residual = (5 * torch.randn(5, 96, generator=generator)).to(dtype)
        next_weight = torch.randn(96, generator=generator).to(dtype)
        scalar = torch.tensor([0.7], dtype=dtype)
        summed_want = residual + _torch_norm(x, weight, 1e-6)
        normed, summed = gemma_norm_add(x, residual, weight, 1e-6, next_weight=next_weight)
        results[f"norm_add/{name}/sum"] = relative(summed, summed_want)
        results[f"norm_add/{name}/next_norm"] = relative(normed, _torch_norm(summed_want, next_weight, 1e-6))
        none, scaled = gemma_norm_add(x, residual, weight, 1e-6, scalar)
        assert none is None
        results[f"norm_add/{name}/scaled"] = relative(scaled, summed_want * scalar)


def _gelu_checks(results: dict[str, float]) -> None:
    import torch.nn.functional as F

    from fitserve.kernels.activation import gelu_tanh_and_mul, gelu_tanh_mul

    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        # wider than the kernel's BLOCK of 1024, so a row takes two programs; |gate| up to ~12
        gate_up = (4 * torch.randn(3, 2 * 1100, generator=generator)).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
        results[f"gelu/{name}/packed"] = relative(gelu_tanh_and_mul(gate_up), want)
        # apart: the per-layer input gate times a strided [T, layers, width] slice
        per_layer = torch.randn(3, 4, 1100, generator=generator).to(dtype)
        want = F.gelu(gate.contiguous(), approximate="tanh") * per_layer[:, 2]
        results[f"gelu/{name}/apart"] = relative(gelu_tanh_mul(gate.contiguous(), per_layer[:, 2]), want)


def _rotary_checks(results: dict[str, float]) -> None:
    from fitserve.kernels.rotary_cache_write import _head_blocks, norm_rotate_q, rotary_cache_write

    generator = torch.Generator().manual_seed(2)
    block_size, num_blocks, eps = 4, 3, 1e-6
    # (rope, head_dim, q heads, kv heads): 31B's sliding and full head counts halved, still split over
    # heads; head dim 128 keeps one program per token
    shapes = [(SLIDING_ROPE, 256, 32, 16), (FULL_ROPE, 512, 16, 4), (SLIDING_ROPE, 128, 8, 2)]
    assert [_head_blocks(d // 2, hq, hk)[2] for _, d, hq, hk in shapes] == [2, 2, 1]
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for rope, head_dim, q_heads, kv_heads in shapes:
            label = f"{name}/{head_dim}"
            rotary = gemma_rotary(rope, head_dim)
            table = rotary.cos_sin_table(torch.device("cpu"), dtype)
            positions = torch.tensor([0, 7, 33, 60])
            slots = torch.tensor([5, 0, -1, 11])
            num_tokens = len(positions)
            # the CPU path's tables (in the model dtype, as HF's), applied in float32 as the kernel does
            tables = _table_rope(rotary, positions, dtype)
            step_rope = StepRope(cos=tables.cos.float(), sin=tables.sin.float())
            q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
            qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=generator).to(dtype)
            q = qkv[:, :q_width].view(num_tokens, q_heads, head_dim)
            k = qkv[:, q_width : q_width + kv_width].view(num_tokens, kv_heads, head_dim)
            v = qkv[:, q_width + kv_width :].view(num_tokens, kv_heads, head_dim)
            q_weight = torch.randn(head_dim, generator=generator).to(dtype)
            k_weight = torch.randn(head_dim, generator=generator).to(dtype)
            want_q = step_rope.rotate(_torch_norm(q, q_weight, eps).float()).to(dtype)
            want_k = step_rope.rotate(_torch_norm(k, k_weight, eps).float()).to(dtype)
            k_before = k.clone()
            cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype)
            norms = (q_weight, eps, k_weight, eps)
            rotary_cache_write(positions, q, k, v, table, cache, slots, qk_norm=norms)
            results[f"rotary/{label}/q"] = relative(q, want_q)
            flat = cache.view(2, num_blocks * block_size, kv_heads, head_dim)
            written = slots >= 0
            results[f"rotary/{label}/k"] = relative(flat[0, slots[written]], want_k[written])
            results[f"rotary/{label}/v"] = relative(flat[1, slots[written]], v[written])
            results[f"rotary/{label}/k_input_kept"] = relative(k, k_before)
            untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
            untouched[slots[written]] = False
            results["rotary/padding_untouched"] = max(
                results.get("rotary/padding_untouched", 0.0), float((flat[:, untouched] - 7.0).abs().max())
            )

            # q alone (a KV-shared layer): a strided view of a packed q-only projection
            packed = torch.randn(num_tokens, q_width + 8, generator=generator).to(dtype)
            q_only = packed[:, :q_width].view(num_tokens, q_heads, head_dim)
            want = step_rope.rotate(_torch_norm(q_only, q_weight, eps).float()).to(dtype)
            norm_rotate_q(positions, q_only, table, (q_weight, eps))
            results[f"q_only/{label}/normed"] = relative(q_only, want)
            plain = torch.randn(num_tokens, q_heads, head_dim, generator=generator).to(dtype)
            want = step_rope.rotate(plain.float()).to(dtype)
            results[f"q_only/{label}/plain"] = relative(norm_rotate_q(positions, plain, table), want)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    assert json.loads(sys.argv[1]) == "all"
    found: dict[str, float] = {}
    for checks in (_norm_checks, _gelu_checks, _rotary_checks):
        checks(found)
    print(json.dumps(found))
