"""The fused MoE kernels (fitserve/kernels/fused_moe.py) on the GPU at the Gemma-4 26B-A4B and Qwen3.6-35B-A3B
expert shapes, against FusedExperts' torch path; inside CUDA graphs captured with one routing and replayed
with another; and with no host sync (torch's sync debug mode). Needs CUDA and triton."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel  # noqa: E402
from fitserve.kernels.fused_moe import choose_config, fused_moe, moe_route  # noqa: E402
from fitserve.layers.moe import FusedExperts  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
# (experts, top_k, hidden, moe_intermediate, activation) of each model's MoE layers
SHAPES = {
    "gemma4-26b-a4b": (128, 8, 2816, 704, lambda x: F.gelu(x, approximate="tanh")),
    "qwen3.6-35b-a3b": (256, 8, 2048, 512, F.silu),
}
TOKENS = (1, 8, 64, 512, 4096)
# |out - ref| <= TOLERANCE * max|ref|. Against the bfloat16 torch path both sides round (at different
# points: the torch path rounds gate, up, act(gate), their product and each expert's output); against
# float32 math only the kernel does.
TOLERANCE_VS_TORCH = 2**-5
TOLERANCE_VS_FLOAT32 = 2**-7


def build(name: str, expert_parallel: tuple[int, int] | None = None) -> FusedExperts:
    """The model's experts with random weights (scaled so that every stage stays of order 1)."""
    experts, _, hidden, inter, activation = SHAPES[name]
    rank, size = expert_parallel or (0, 1)
    set_tensor_parallel(TensorParallel(rank, size))
    try:
        module = FusedExperts(experts, hidden, inter, activation, expert_parallel=expert_parallel is not None)
    finally:
        set_tensor_parallel(TensorParallel())
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    local = module.local_experts
    gate_up = torch.randn(local, 2 * inter, hidden, device=DEVICE, generator=generator) * hidden**-0.5
    down = torch.randn(local, hidden, inter, device=DEVICE, generator=generator) * inter**-0.5
    module.gate_up_proj.data = gate_up.to(DTYPE)
    module.down_proj.data = down.to(DTYPE)
    return module


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request) -> tuple[str, FusedExperts]:
    module = build(request.param)
    yield request.param, module
    del module
    torch.cuda.empty_cache()


def routing(name: str, tokens: int, seed: int, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int64 and topk_weights [T, k] float32 as a softmax router gives them; skew=True
    sends every token to the same k experts (one expert's rows fill many blocks)."""
    experts, top_k = SHAPES[name][:2]
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=DEVICE, generator=generator)
    if skew:
        logits[:, 3 : 3 + top_k] += 100.0
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """max |out - reference| / max |reference| (over 1e-6: a rank whose experts no token chose gives 0)."""
    scale = reference.float().abs().max().clamp_min(1e-6)
    return ((out.float() - reference.float()).abs().max() / scale).item()


def float32_reference(module: FusedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """The first few tokens' outputs in float32 math from the same (bfloat16) inputs and weights."""
    rows = []
    for t in range(min(x.shape[0], 8)):
        total = torch.zeros(x.shape[1], device=DEVICE)
        for slot in range(ids.shape[1]):
            expert = int(ids[t, slot]) - module.first_expert
            if not 0 <= expert < module.local_experts:
                continue
            gate, up = (module.gate_up_proj[expert].float() @ x[t].float()).chunk(2)
            total += weights[t, slot] * (module.down_proj[expert].float() @ (module.activation(gate) * up))
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("tokens", TOKENS)
def test_matches_torch_path(model, tokens: int) -> None:
    name, module = model
    x = torch.randn(tokens, SHAPES[name][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, tokens, seed=tokens)
    out = module(x, ids, weights, reduce=False)
    assert out.shape == x.shape and out.dtype == DTYPE
    assert relative_error(out, module.reference(x, ids, weights)) <= TOLERANCE_VS_TORCH
    exact = float32_reference(module, x, ids, weights)
    assert relative_error(out[: exact.shape[0]], exact) <= TOLERANCE_VS_FLOAT32
    assert torch.equal(out, module(x, ids, weights, reduce=False))  # same result on every run


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_skewed_routing(model, tokens: int) -> None:
    name, module = model
    x = torch.randn(tokens, SHAPES[name][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, tokens, seed=7, skew=True)
    assert relative_error(module(x, ids, weights, reduce=False), module.reference(x, ids, weights)) <= (
        TOLERANCE_VS_TORCH
    )


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_expert_parallel_rank_share(name: str, tokens: int) -> None:
    """Rank 1 of 4 under expert parallel: only its quarter of the experts count."""
    module = build(name, expert_parallel=(1, 4))
    x = torch.randn(tokens, SHAPES[name][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, tokens, seed=tokens + 1)
    out = module(x, ids, weights, reduce=False)
    reference = module.reference(x, ids, weights)
    assert relative_error(out, reference) <= TOLERANCE_VS_TORCH
    mine = ((ids >= module.first_expert) & (ids < module.first_expert + module.local_experts)).any(dim=1)
    assert not out[~mine].any()  # tokens with none of this rank's experts get exact zeros


def test_unchosen_experts_are_never_read(model) -> None:
    """NaN in every expert but the batch-1 token's k: the output stays finite and right."""
    name, module = model
    x = torch.randn(1, SHAPES[name][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, 1, seed=3)
    saved = module.gate_up_proj.data.clone(), module.down_proj.data.clone()
    others = torch.ones(module.local_experts, dtype=torch.bool, device=DEVICE)
    others[ids[0]] = False
    try:
        module.gate_up_proj.data[others] = float("nan")
        module.down_proj.data[others] = float("nan")
        out = module(x, ids, weights, reduce=False)
        assert torch.isfinite(out).all()
        assert relative_error(out, module.reference(x, ids, weights)) <= TOLERANCE_VS_TORCH
    finally:
        module.gate_up_proj.data.copy_(saved[0])
        module.down_proj.data.copy_(saved[1])


@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_graph_replays_any_routing(model, tokens: int) -> None:
    """Captured with every token on the same k experts, replayed with spread routings (more blocks in use)
    and back: each replay matches the torch path for the routing it was given."""
    name, module = model
    hidden = SHAPES[name][2]
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, tokens, seed=11, skew=True)
    module(x, ids, weights, reduce=False)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(x, ids, weights, reduce=False)
    for seed, skew in ((12, False), (13, False), (14, True)):
        new_ids, new_weights = routing(name, tokens, seed=seed, skew=skew)
        x.copy_(torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE))
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, module.reference(x, ids, weights)) <= TOLERANCE_VS_TORCH, (seed, skew)


def test_no_host_sync(model) -> None:
    """torch's sync debug mode raises on any host sync: the fused path has none, the torch path has."""
    name, module = model
    x = torch.randn(8, SHAPES[name][2], device=DEVICE, dtype=DTYPE)
    ids, weights = routing(name, 8, seed=5)
    module(x, ids, weights, reduce=False)  # compile first (compiling may copy to the host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        module(x, ids, weights, reduce=False)
        with pytest.raises(RuntimeError):
            module.reference(x, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_routing_buffers_at_scale() -> None:
    """moe_route at T = 4096 (the multi-program scatter): every pair once, each block one expert's."""
    name = "qwen3.6-35b-a3b"
    experts = SHAPES[name][0]
    ids, _ = routing(name, 4096, seed=2)
    config = choose_config(4096, 2048, 512, 8, experts)
    block_m = config.block_m
    assert not config.one_program_routing
    sorted_pairs, block_expert, num_blocks = moe_route(ids, experts, 0, block_m, one_program=False)
    used = int(num_blocks)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m).sum())
    rows = sorted_pairs[: used * block_m].long()
    real = rows < ids.numel()
    assert torch.equal(rows[real].sort().values, torch.arange(ids.numel(), device=DEVICE))
    row_expert = block_expert[:used].long().repeat_interleave(block_m)
    assert torch.equal(ids.reshape(-1)[rows[real]], row_expert[real])


def test_float32_weights_of_the_loop_are_refused() -> None:
    x = torch.zeros(2, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="x's dtype"):
        fused_moe(
            x,
            torch.zeros(4, 64, 64, device=DEVICE),
            torch.zeros(4, 64, 32, device=DEVICE),
            torch.zeros(2, 2, dtype=torch.int64, device=DEVICE),
            torch.ones(2, 2, device=DEVICE),
            "silu",
        )
