"""Programmatic dependent launch: a chain of dependent kernels gives the same bits with it as without,
eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import dependent_launch  # noqa: E402
from fitserve.kernels.activation import silu_and_mul  # noqa: E402
from fitserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from fitserve.kernels.skinny_gemm import skinny_gemm  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def test_used_from_sm90_only() -> None:
    supported = torch.cuda.get_device_capability() >= (9, 0)
    assert dependent_launch.pdl_kwargs(DEVICE) == {"USE_PDL": supported, "launch_pdl": supported}
    assert dependent_launch.pdl_kwargs(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}


def _chain(
    x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], norm: torch.Tensor
) -> torch.Tensor:
    """Layers whose every kernel reads what the one before it wrote: a missing wait reads stale data."""
    residual = x.clone()
    hidden = rms_norm(x, norm, 1e-5)
    for up, down in weights:
        hidden = skinny_gemm(silu_and_mul(skinny_gemm(hidden, up)), down)
        hidden, residual = fused_add_rms_norm(hidden, residual, norm, 1e-5)
    return hidden


def test_a_dependent_chain_is_bitwise_the_same_with_and_without(monkeypatch) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4096, device=DEVICE, dtype=torch.bfloat16)
    norm = (1 + 0.1 * torch.randn(4096, device=DEVICE)).to(torch.bfloat16)
    weights = [
        (
            (0.02 * torch.randn(2 * 4096, 4096, device=DEVICE)).to(torch.bfloat16),
            (0.02 * torch.randn(4096, 4096, device=DEVICE)).to(torch.bfloat16),
        )
        for _ in range(12)
    ]
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    expected = _chain(x, weights, norm)
    monkeypatch.setattr(dependent_launch, "ENABLED", True)
    assert torch.equal(_chain(x, weights, norm), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(x, weights, norm)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        assert torch.equal(captured, expected)
