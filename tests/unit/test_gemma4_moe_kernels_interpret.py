"""Gemma-4's MoE kernels under Triton's CPU interpreter.

kernels/moe_router.py's router_topk against Gemma4Router's torch ops (softmax in float32, topk,
renormalise, times per_expert_scale): 26B-A4B's 128 experts with top 8, a count that is not a power of two
(96 experts, top 3) and bfloat16 scores; the expert ids exactly (distinct scores), the weights to float32
rounding. Then the router's kernel path (norm with the folded scale, projection, router_topk) against its
torch path on a tiny config. kernels/gemma_moe_norms.py's gemma_moe_head and gemma_moe_tail against the
torch ops they replace, in float32 and bfloat16 (the tail with and without layer_scalar). Skipped where
triton is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
CASES = [(5, 128, 8, "float32"), (3, 96, 3, "float32"), (4, 128, 8, "bfloat16"), (1, 8, 1, "float32")]


def torch_router(scores: torch.Tensor, expert_scale: torch.Tensor, top_k: int):
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * expert_scale[ids], ids


def _check_cases() -> dict:
    from fitserve.kernels.moe_router import router_topk

    results = {}
    for tokens, experts, top_k, dtype_name in CASES:
        generator = torch.Generator().manual_seed(tokens * experts + top_k)
        dtype = getattr(torch, dtype_name)
        # distinct scores in every dtype (bfloat16 rounds random ones into ties, whose order topk leaves open)
        ranks = torch.stack([torch.randperm(experts, generator=generator) for _ in range(tokens)])
        scores = ((ranks - experts / 2) * (6 / experts)).to(dtype)
        expert_scale = torch.rand(experts, generator=generator) + 0.5
        want_weights, want_ids = torch_router(scores, expert_scale, top_k)
        weights, ids = router_topk(scores, expert_scale, top_k)
        name = f"{tokens}x{experts}/top{top_k}/{dtype_name}"
        results[name] = {
            "ids_equal": bool(torch.equal(ids, want_ids)),
            "ids_dtype": str(ids.dtype),
            "weight_error": (weights - want_weights).abs().max().item(),
        }
    return results


def _check_router() -> dict:
    from fitserve.models import gemma4_layers

    config = SimpleNamespace(hidden_size=64, top_k_experts=4, num_experts=16, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    router = gemma4_layers.Gemma4Router(config)
    with torch.no_grad():
        router.proj.weight.normal_(0, 0.5)
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 1.5)
    x = torch.randn(6, 64)
    want_weights, want_ids = router.forward(x)
    got_weights, got_ids = router._forward_kernels(x)
    # the folded weight follows a reloaded scale
    with torch.no_grad():
        router.scale.mul_(2.0)
    rescaled_weights, rescaled_ids = router.forward(x)
    refolded_weights, refolded_ids = router._forward_kernels(x)
    return {
        "router": {
            "ids_equal": bool(torch.equal(got_ids, want_ids)),
            "weight_error": (got_weights - want_weights).abs().max().item(),
            "refolded_ids_equal": bool(torch.equal(refolded_ids, rescaled_ids)),
            "refolded_weight_error": (refolded_weights - rescaled_weights).abs().max().item(),
        }
    }


def _check_tail() -> dict:
    from fitserve.kernels.gemma_moe_norms import gemma_moe_tail
    from fitserve.models.gemma4_layers import GemmaRMSNorm

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for with_scalar in (False, True):
            generator = torch.Generator().manual_seed(1)
            dense, routed, residual = (torch.randn(5, 96, generator=generator).to(dtype) for _ in range(3))
            norms = [GemmaRMSNorm(96, 1e-6) for _ in range(3)]
            for norm in norms:
                norm.weight.data = (torch.rand(96, generator=generator) + 0.5).to(dtype)
            scalar = torch.tensor([0.75], dtype=dtype) if with_scalar else None
            want = residual + norms[2](norms[0](dense) + norms[1](routed))
            if scalar is not None:
                want = want * scalar
            got = gemma_moe_tail(dense, routed, residual, *(n.weight for n in norms), 1e-6, scalar)
            name = f"tail/{str(dtype).removeprefix('torch.')}/{'scalar' if with_scalar else 'plain'}"
            results[name] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return results


def _check_head() -> dict:
    from fitserve.kernels.gemma_moe_norms import gemma_moe_head
    from fitserve.models import gemma4_layers

    config = SimpleNamespace(hidden_size=96, top_k_experts=2, num_experts=4, rms_norm_eps=1e-6)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator().manual_seed(2)
        x, residual = (torch.randn(5, 96, generator=generator).to(dtype) for _ in range(2))
        norms = [gemma4_layers.GemmaRMSNorm(96, 1e-6) for _ in range(3)]
        for norm in norms:
            norm.weight.data = (torch.rand(96, generator=generator) + 0.5).to(dtype)
        router = gemma4_layers.Gemma4Router(config).to(dtype)
        router.scale.data = (torch.rand(96, generator=generator) + 0.5).to(dtype)
        summed = residual + norms[0](x)
        want = (
            summed,
            norms[1](summed),
            norms[2](summed),
            router.norm(summed) * router.scale * router.root_size,
        )
        got = gemma_moe_head(x, residual, *(n.weight for n in norms), router.norm_weight(), 1e-6)
        for part, g, w in zip(("sum", "dense", "routed", "router"), got, want):
            error = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
            results[f"head/{str(dtype).removeprefix('torch.')}/{part}"] = error
    return results


@pytest.fixture(scope="module")
def results() -> dict:
    return run_in_interpreter(__file__, "all")


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}/top{c[2]}/{c[3]}")
def test_router_topk_matches_torch(results, case):
    tokens, experts, top_k, dtype_name = case
    got = results[f"{tokens}x{experts}/top{top_k}/{dtype_name}"]
    assert got["ids_equal"], got
    assert got["ids_dtype"] == "torch.int64"
    assert got["weight_error"] < 1e-5, got


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scalar", ["plain", "scalar"])
def test_moe_tail_matches_torch(results, dtype, scalar):
    # the kernel rounds where torch does; float32 differs by summation order, bfloat16 by one rounding
    assert results[f"tail/{dtype}/{scalar}"] < (1e-5 if dtype == "float32" else 2**-7), results


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("part", ["sum", "dense", "routed", "router"])
def test_moe_head_matches_torch(results, dtype, part):
    # the router's input is rounded once where torch rounds three times: up to two roundings apart
    limit = 1e-5 if dtype == "float32" else 2**-6 if part == "router" else 2**-7
    assert results[f"head/{dtype}/{part}"] < limit, results


@needs_triton
def test_router_kernel_path_matches_torch_path(results):
    got = results["router"]
    assert got["ids_equal"] and got["refolded_ids_equal"], got
    assert got["weight_error"] < 1e-5 and got["refolded_weight_error"] < 1e-5, got


def test_router_topk_refuses_bad_shapes():
    pytest.importorskip("triton")
    from fitserve.kernels.moe_router import router_topk

    with pytest.raises(ValueError, match="top_k 9"):
        router_topk(torch.zeros(2, 8), torch.ones(8), 9)
    with pytest.raises(ValueError, match="expert_scale"):
        router_topk(torch.zeros(2, 8), torch.ones(7), 2)
    from fitserve.kernels.gemma_moe_norms import gemma_moe_tail

    x, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"shapes \[\(2, 7\), \(2, 8\)\]"):
        gemma_moe_tail(x, torch.zeros(2, 7), x, w, w, w, 1e-6)
    from fitserve.kernels.gemma_moe_norms import gemma_moe_head

    with pytest.raises(ValueError, match=r"weights \[\(8,\), \(8,\), \(8,\), \(7,\)\]"):
        gemma_moe_head(x, x, w, w, w, torch.ones(7), 1e-6)


if __name__ == "__main__":
    import triton  # noqa: F401

    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    import json

    print(json.dumps({**_check_cases(), **_check_router(), **_check_tail(), **_check_head()}))
    sys.exit(0)
