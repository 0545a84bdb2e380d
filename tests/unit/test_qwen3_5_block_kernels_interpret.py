"""The kernels Qwen3.5/3.6's decoder layers take on CUDA around their projections, under Triton's CPU
interpreter against the torch path they replace (models/qwen3_5_layers.py's CPU forward):

- Qwen3_5RMSNorm (weight stored as the offset from 1, one rounding after the weight): kernels/norm.py's
  rms_norm with weight_offset 1 and round_normed False, on rows and on a strided per-head view; and
  fused_add_rms_norm likewise against `add_and_norm`'s torch form (the sum rounded first);
- the MLP's activation with torch's roundings (silu_and_mul's as_torch: silu rounded before the product);
- the sparse MoE block's routing: router_topk without a scale, each weight rounded to the scores' dtype;
- the block's end: kernels/shared_expert_gate.py against sigmoid(shared_expert_gate(x)) * shared + routed.

With their defaults the same kernels keep Llama's order (tests/gpu/test_kernels.py checks it on a GPU).
Skipped where triton is not installed. Tolerances: float32 to summation order; bfloat16 exact
(the float32 sums differ in another order only below a bfloat16 rounding at these seeds; Llama's order,
rounding before the weight, is 0.004 off).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
FLOAT32 = 1e-5
DTYPES = ("float32", "bfloat16")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def _norm_cases(dtype: torch.dtype) -> dict[str, float]:
    from fitserve.kernels.norm import fused_add_rms_norm, rms_norm
    from fitserve.models.qwen3_5_layers import Qwen3_5RMSNorm

    generator = torch.Generator().manual_seed(1)
    norm = Qwen3_5RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=generator) * 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(5, 48, generator=generator) * 3).to(dtype)
    errors = {"rows": _relative(rms_norm(x, norm.weight, 1e-6, 1.0, False), norm(x))}
    heads = (torch.randn(5, 3, 96, generator=generator)).to(dtype)[..., :48]  # a strided per-head view
    errors["heads"] = _relative(rms_norm(heads, norm.weight, 1e-6, 1.0, False), norm(heads))
    mixed = torch.randn(5, 48, generator=generator).to(dtype)
    residual = (torch.randn(5, 48, generator=generator) * 2).to(dtype)
    want_normed, want_sum = norm.add_and_norm(mixed.clone(), residual.clone())
    got_normed, got_sum = fused_add_rms_norm(mixed.clone(), residual.clone(), norm.weight, 1e-6, 1.0, False)
    errors["add_sum"] = _relative(got_sum, want_sum)
    errors["add_normed"] = _relative(got_normed, want_normed)
    return errors


def _mlp_cases(dtype: torch.dtype) -> dict[str, float]:
    from fitserve.kernels.activation import silu_and_mul

    generator = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 2 * 40, generator=generator) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return {"silu_as_torch": _relative(silu_and_mul(gate_up, as_torch=True), F.silu(gate) * up)}


def _router_cases(dtype: torch.dtype) -> dict[str, float]:
    from fitserve.kernels.moe_router import router_topk

    generator = torch.Generator().manual_seed(2)
    experts, top_k = 24, 4
    # distinct scores (random ones round into ties in bfloat16, whose order topk leaves open)
    ranks = torch.stack([torch.randperm(experts, generator=generator) for _ in range(3)])
    scores = ((ranks - experts / 2) * (6 / experts)).to(dtype)
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
    want_weights, want_ids = torch.topk(probabilities, top_k, dim=-1)
    want_weights = (want_weights / want_weights.sum(dim=-1, keepdim=True)).to(dtype).float()
    weights, ids = router_topk(scores, None, top_k, round_to_scores_dtype=True)
    return {
        "router_ids_differ": float(not torch.equal(ids, want_ids)),
        "router_weights": (weights - want_weights).abs().max().item(),
        "router_weights_dtype_float32": float(weights.dtype == torch.float32),
    }


def _shared_expert_cases(dtype: torch.dtype) -> dict[str, float]:
    from fitserve.kernels.shared_expert_gate import add_gated_shared_expert

    generator = torch.Generator().manual_seed(3)
    x, routed, shared = (torch.randn(4, 40, generator=generator).to(dtype) for _ in range(3))
    gate_weight = (torch.randn(1, 40, generator=generator) * 0.3).to(dtype)
    want = routed + torch.sigmoid(torch.nn.functional.linear(x, gate_weight)) * shared
    return {"shared_expert": _relative(add_gated_shared_expert(routed, shared, x, gate_weight), want)}


def _run_all(_: object) -> dict[str, float]:
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    errors = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        for case in (_norm_cases, _mlp_cases, _router_cases, _shared_expert_cases):
            errors.update({f"{key}/{name}": value for key, value in case(dtype).items()})
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return run_in_interpreter(__file__, "all")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["rows", "heads", "add_sum", "add_normed", "silu_as_torch", "shared_expert"])
def test_kernel_matches_the_torch_path(errors: dict[str, float], case: str, dtype: str) -> None:
    # bfloat16: equal, the same roundings in the same order (the float32 sums differ only below them here)
    assert errors[f"{case}/{dtype}"] <= (FLOAT32 if dtype == "float32" else 0.0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_router_rounds_weights_to_the_scores_dtype(errors: dict[str, float], dtype: str) -> None:
    assert errors[f"router_ids_differ/{dtype}"] == 0.0
    assert errors[f"router_weights_dtype_float32/{dtype}"] == 1.0
    # float32: the same float32 ops; bfloat16: both rounded to bfloat16, so equal unless the float32 sums
    # differ in the last place across a rounding boundary
    assert errors[f"router_weights/{dtype}"] <= (1e-6 if dtype == "float32" else 2**-8)


@needs_triton
def test_shared_expert_gate_refuses_mismatched_shapes() -> None:
    from fitserve.kernels.shared_expert_gate import add_gated_shared_expert

    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"gate_weight \(1, 7\)"):
        add_gated_shared_expert(x, x, x, torch.zeros(1, 7))
    with pytest.raises(ValueError, match="one dtype"):
        add_gated_shared_expert(x, x.bfloat16(), x, torch.zeros(1, 8))


@needs_triton
def test_router_refuses_a_scale_of_the_wrong_size() -> None:
    from fitserve.kernels.moe_router import router_topk

    with pytest.raises(ValueError, match=r"expert_scale \(7,\)"):
        router_topk(torch.zeros(2, 8), torch.ones(7), 2)


if __name__ == "__main__":
    import json

    print(json.dumps(_run_all(json.loads(sys.argv[1]))))
