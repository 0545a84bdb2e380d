"""The int4 fused MoE (fitserve/kernels/fused_moe_int4.py) on the GPU at Qwen3-30B-A3B's expert shape (128
experts, top 8, hidden 2048, intermediate 768, groups of 128), against the experts' torch path over the
dequantized weights (layers/moe_int4.py Int4FusedExperts.reference); replayed in a CUDA graph captured with
one routing and replayed with another; with expert parallel. Needs CUDA and triton."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel  # noqa: E402
from fitserve.layers.moe_int4 import Int4FusedExperts  # noqa: E402
from fitserve.layers.quantization.quant_config import Int4Format  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = (1, 4, 8, 64, 512)  # 1 and 4: kernels/moe_int4_decode.py; 8 on: the grouped path
TOLERANCE = 2**-6  # |out - ref| <= TOLERANCE * max|ref|, both bfloat16 (rounded at different points)


def build(expert_parallel: tuple[int, int] | None = None) -> Int4FusedExperts:
    rank, size = expert_parallel or (0, 1)
    set_tensor_parallel(TensorParallel(rank, size))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            fmt = Int4Format("awq", "awq", 128, symmetric=False, act_order=False)
            experts = Int4FusedExperts(
                EXPERTS,
                HIDDEN,
                INTER,
                torch.nn.functional.silu,
                fmt,
                "test.experts",
                expert_parallel is not None,
            )
            experts.initialize_dummy(seed=0, std=0.05)
    finally:
        torch.set_default_dtype(previous)
        set_tensor_parallel(TensorParallel())
    return experts


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(tokens, EXPERTS, generator=generator, device=DEVICE)
    weights, ids = scores.topk(TOP_K, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.float().abs().max().item()
    error = (out.float() - ref.float()).abs().max().item()
    assert error <= TOLERANCE * scale, f"max |out - ref| {error:.4g} > {TOLERANCE} x {scale:.4g}"


@pytest.fixture(scope="module")
def experts() -> Int4FusedExperts:
    return build()


@pytest.mark.parametrize("tokens", TOKENS)
def test_kernel_matches_the_dequantized_torch_path(experts, tokens):
    assert_kernels_match_the_torch_path(experts, tokens)


def assert_kernels_match_the_torch_path(experts: torch.nn.Module, tokens: int) -> None:
    """The experts' GPU kernels against their torch reference on `tokens` random tokens."""
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = routing(tokens, seed=tokens)
    out = experts(x, ids, weights, reduce=False)
    assert_close(out, experts.reference(x, ids, weights))


def test_a_graph_replays_another_routing(experts):
    assert_a_graph_replays_another_routing(experts)


def assert_a_graph_replays_another_routing(experts: torch.nn.Module) -> None:
    """One token's MoE captured in a CUDA graph with one routing and replayed with another: the second
    routing's result."""
    x = torch.randn(1, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = routing(1, seed=1)
    for _ in range(2):  # compile, then warm
        experts(x, ids, weights, reduce=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, ids, weights, reduce=False)
    new_ids, new_weights = routing(1, seed=2)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, experts.reference(x, new_ids, new_weights))


def test_expert_parallel_ranks_sum_to_the_whole():
    assert_ranks_sum_to_the_whole(build(), [build((rank, 2)) for rank in range(2)])


def assert_ranks_sum_to_the_whole(whole: torch.nn.Module, ranks: list[torch.nn.Module]) -> None:
    """The expert-parallel ranks' partial outputs of 8 tokens add up to one rank's."""
    x = torch.randn(8, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = routing(8, seed=3)
    parts = sum(rank(x, ids, weights, reduce=False).float() for rank in ranks)
    assert_close(parts, whole(x, ids, weights, reduce=False))
