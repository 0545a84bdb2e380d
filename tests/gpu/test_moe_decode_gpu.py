"""The decode-sized MoE path (fitserve/kernels/moe_decode.py) on the GPU at Qwen3.6-35B-A3B's shapes with its
shared expert, and at Gemma-4 26B-A4B's without: against the torch path, against the grouped path plus the
shared expert's own kernels (what the model ran before), inside a CUDA graph replayed with other routings,
and under expert parallel. tests/gpu/test_fused_moe_gpu.py covers the routed part at T = 1 and 8 through
fused_moe. Needs CUDA and triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import fused_moe as fm  # noqa: E402
from fitserve.kernels import moe_decode as md  # noqa: E402
from fitserve.kernels.activation import silu_and_mul  # noqa: E402
from fitserve.kernels.shared_expert_gate import add_gated_shared_expert  # noqa: E402
from tests.gpu.test_fused_moe_gpu import SHAPES, build, relative_error, routing  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
QWEN = "qwen3.6-35b-a3b"
TOLERANCE_VS_TORCH = 2**-5


def shared_expert(seed: int = 1) -> md.SharedExpert:
    _, _, hidden, inter, _ = SHAPES[QWEN]
    generator = torch.Generator(device=DEVICE).manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, device=DEVICE, generator=generator) * shape[-1] ** -0.5).to(DTYPE)

    return md.SharedExpert(weight(2 * inter, hidden), weight(hidden, inter), weight(1, hidden))


def torch_path(module, shared: md.SharedExpert, x, ids, weights) -> torch.Tensor:
    """Qwen3.5's block in torch from the routing on: routed experts plus the gated shared expert."""
    gate, up = F.linear(x, shared.gate_up_proj).chunk(2, dim=-1)
    down = F.linear(F.silu(gate) * up, shared.down_proj)
    return module.reference(x, ids, weights) + torch.sigmoid(F.linear(x, shared.gate_weight)) * down


def before(module, shared: md.SharedExpert, x, ids, weights) -> torch.Tensor:
    """The grouped path and the shared expert's own kernels, as the model ran a decode step before."""
    config = fm.choose_config(x.shape[0], x.shape[1], module.intermediate_per_rank, ids.shape[1], 256)
    routed = fm.fused_moe(x, module.gate_up_proj, module.down_proj, ids, weights, "silu", 0, config)
    mid = silu_and_mul(F.linear(x, shared.gate_up_proj), as_torch=True)
    return add_gated_shared_expert(routed, F.linear(mid, shared.down_proj), x, shared.gate_weight)


@pytest.fixture(scope="module")
def qwen():
    module = build(QWEN)
    yield module, shared_expert()
    del module
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_shared_expert_matches_torch_and_the_grouped_path(qwen, tokens: int) -> None:
    module, shared = qwen
    x = torch.randn(tokens, SHAPES[QWEN][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(QWEN, tokens, seed=tokens)
    assert module.takes_shared_expert(x, shared)
    out = module(x, ids, weights, reduce=False, shared=shared)
    assert out.shape == x.shape and out.dtype == DTYPE
    assert relative_error(out, torch_path(module, shared, x, ids, weights)) <= TOLERANCE_VS_TORCH
    # the same roundings as before, in other summation orders: a value moves by a step or two
    assert relative_error(out, before(module, shared, x, ids, weights)) <= 2**-6
    assert torch.equal(out, module(x, ids, weights, reduce=False, shared=shared))


def test_graph_replays_any_routing(qwen) -> None:
    module, shared = qwen
    tokens, hidden = 4, SHAPES[QWEN][2]
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    ids, weights = routing(QWEN, tokens, seed=21, skew=True)
    module(x, ids, weights, reduce=False, shared=shared)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x, ids, weights, reduce=False, shared=shared)
    for seed in (22, 23):
        new_ids, new_weights = routing(QWEN, tokens, seed=seed)
        x.copy_(torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE))
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, torch_path(module, shared, x, ids, weights)) <= TOLERANCE_VS_TORCH, seed


@pytest.mark.parametrize("name", list(SHAPES))
def test_expert_parallel_rank_share(name: str) -> None:
    """Rank 1 of 4 holds a quarter of the experts: a token with none of them gets exact zeros from the
    routed part; the grouped path gives the same share."""
    module = build(name, expert_parallel=(1, 4))
    tokens = 8
    x = torch.randn(tokens, SHAPES[name][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, tokens, seed=31)
    args = (x, module.gate_up_proj, module.down_proj, ids, weights, module.kernel_activation)
    out = md.moe_decode(*args, module.first_expert)
    assert relative_error(out, module.reference(x, ids, weights)) <= TOLERANCE_VS_TORCH
    mine = ((ids >= module.first_expert) & (ids < module.first_expert + module.local_experts)).any(dim=1)
    assert not out[~mine].any()


def test_no_host_sync(qwen) -> None:
    module, shared = qwen
    x = torch.randn(2, SHAPES[QWEN][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(QWEN, 2, seed=41)
    module(x, ids, weights, reduce=False, shared=shared)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        module(x, ids, weights, reduce=False, shared=shared)
    finally:
        torch.cuda.set_sync_debug_mode("default")
