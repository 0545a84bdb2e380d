"""Qwen3.5/3.6's fused CUDA paths (models/qwen3_5_layers.py with FUSED_ON_CUDA) against the same layers'
torch ops on the same GPU (FUSED_ON_CUDA off), at the 27B's and 35B-A3B's sizes in bfloat16: the layer
norms alone and with the residual add, the MLP's activation, the MoE block (router, experts, gated shared
expert), and the kernels the attention and DeltaNet layers call (q/k norm with partial rotation, the
output gate, the gated output norm). The kernels round as torch rounds; what may differ is the order of
a float32 sum (a norm's sum of squares, the shared expert gate's dot product): a few values in a million
by one bfloat16 step, never more (a whole MoE row where the gate's logit rounds the other way).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fitserve.models import qwen3_5_layers as layers
from fitserve.models.qwen3_5_delta_net import GatedRMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPE = torch.bfloat16
MOST_DIFFERING = 1e-3  # fraction of values allowed one rounding step apart


def _close(got: torch.Tensor, want: torch.Tensor, most_differing: float = MOST_DIFFERING) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = got != want
    assert differ.float().mean().item() <= most_differing, f"{int(differ.sum())} of {want.numel()} differ"
    # one bfloat16 step of the larger value, or of the row's largest where a sum cancels (a rotated pair,
    # the residual add) and one step of its terms is what a value may move by
    step = want.float().abs().clamp_min(got.float().abs()) * 2**-7
    row_step = want.float().abs().amax(-1, keepdim=True) * 2**-8
    worst = ((got.float() - want.float()).abs() - step.clamp_min(row_step)).max().item()
    assert worst <= 0.0, f"a value differs by {worst} more than one rounding step"


def _both(monkeypatch: pytest.MonkeyPatch, run) -> tuple[torch.Tensor, torch.Tensor]:
    """run() with the fused kernels, then with torch's ops (FUSED_ON_CUDA off)."""
    fused = run()
    monkeypatch.setattr(layers, "FUSED_ON_CUDA", False)
    plain = run()
    monkeypatch.setattr(layers, "FUSED_ON_CUDA", True)
    return fused, plain


@pytest.mark.parametrize("tokens", [1, 7, 512])
def test_layer_norms_and_residual_add(monkeypatch, tokens) -> None:
    torch.manual_seed(tokens)
    norm = layers.Qwen3_5RMSNorm(5120, 1e-6).to("cuda", DTYPE)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(tokens, 5120, device="cuda", dtype=DTYPE) * 4
    _close(*_both(monkeypatch, lambda: norm(x)))
    heads = torch.randn(tokens, 24, 512, device="cuda", dtype=DTYPE)[..., :256]  # q_norm's strided view
    head_norm = layers.Qwen3_5RMSNorm(256, 1e-6).to("cuda", DTYPE)
    _close(*_both(monkeypatch, lambda: head_norm(heads)))
    mixed = torch.randn(tokens, 5120, device="cuda", dtype=DTYPE)
    fused, plain = _both(monkeypatch, lambda: norm.add_and_norm(mixed.clone(), x.clone()))
    assert torch.equal(fused[1], plain[1])  # the sum: one bfloat16 add either way
    _close(fused[0], plain[0])


@pytest.mark.parametrize("tokens", [1, 512])
def test_mlp_activation(monkeypatch, tokens) -> None:
    torch.manual_seed(0)
    mlp = layers.Qwen3_5MLP(1024, 2048).to("cuda", DTYPE)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0, 0.05)
    x = torch.randn(tokens, 1024, device="cuda", dtype=DTYPE)
    _close(*_both(monkeypatch, lambda: mlp(x)))


@pytest.mark.parametrize("tokens", [1, 4, 64])
def test_moe_block(monkeypatch, tokens) -> None:
    """Qwen3.6-35B-A3B's block sizes (256 experts, top 8, hidden 2048): the router kernel's experts and
    weights, the fused experts and the gated shared expert against torch's softmax / topk / sigmoid."""
    config = SimpleNamespace(
        hidden_size=2048,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )
    torch.manual_seed(1)
    block = layers.Qwen3_5SparseMoeBlock(config).to("cuda", DTYPE)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.03)
    x = torch.randn(tokens, 2048, device="cuda", dtype=DTYPE)
    scores = torch.softmax(block.gate(x), dim=-1, dtype=torch.float32)
    ranked = scores.sort(dim=-1, descending=True).values
    # a token whose 8th and 9th experts tie in its bfloat16 scores may pick either: judged on the others
    untied = ranked[:, 7] > ranked[:, 8]
    assert int(untied.sum()) >= tokens * 3 // 4
    fused, plain = _both(monkeypatch, lambda: block(x))
    # the shared expert's gate logit is one dot product summed in another order than cuBLAS's: where its
    # bfloat16 rounding differs, sigmoid(g) moves a step and so does much of the token's row (a third of
    # it at batch 1 on an H100); the gated term and the routed sum may cancel, so a value moves by a step
    # of the terms, bounded by four steps of the row's largest value
    fused, plain = fused[untied].float(), plain[untied].float()
    bound = plain.abs().amax(-1, keepdim=True) * 2**-6
    assert bool(((fused - plain).abs() <= bound).all())
    assert (fused - plain).abs().mean().item() <= 2**-9 * plain.abs().mean().item()


@pytest.mark.parametrize("tokens", [1, 512])
def test_attention_and_delta_net_kernels(tokens) -> None:
    """The 27B's full layers (24 heads and 4 KV heads of 256, a quarter rotated) and DeltaNet output norm
    (48 value heads of 128): each kernel against the torch ops the layer runs without it."""
    from fitserve.kernels.activation import sigmoid_gate_mul
    from fitserve.kernels.gated_rms_norm import gated_rms_norm
    from fitserve.kernels.qk_norm_partial_rope import qk_norm_partial_rope

    torch.manual_seed(2)
    config = SimpleNamespace(head_dim=256, rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25})
    rope = layers.PartialRope(
        torch.arange(tokens, device="cuda") * 37, layers.rope_inv_freq(config).cuda(), DTYPE
    )
    q_norm, k_norm = (layers.Qwen3_5RMSNorm(256, 1e-6).to("cuda", DTYPE) for _ in range(2))
    with torch.no_grad():
        q_norm.weight.normal_(0, 0.3)
        k_norm.weight.normal_(0, 0.3)
    query_gate = torch.randn(tokens, 24, 512, device="cuda", dtype=DTYPE)
    k = torch.randn(tokens, 4, 256, device="cuda", dtype=DTYPE)
    q_got, k_got = qk_norm_partial_rope(
        query_gate, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos.squeeze(1), rope.sin.squeeze(1)
    )
    layers.FUSED_ON_CUDA = False
    try:
        _close(q_got, rope.rotate(q_norm(query_gate[..., :256])).contiguous())
        _close(k_got, rope.rotate(k_norm(k)).contiguous())
    finally:
        layers.FUSED_ON_CUDA = True
    out = torch.randn(tokens, 24 * 256, device="cuda", dtype=DTYPE)
    gate = query_gate[..., 256:].reshape(tokens, -1)
    assert torch.equal(sigmoid_gate_mul(out, query_gate), out * torch.sigmoid(gate))
    norm = GatedRMSNorm(128, 1e-6).to("cuda", DTYPE)
    with torch.no_grad():
        norm.weight.normal_(1, 0.2)
    core = torch.randn(tokens, 48, 128, device="cuda", dtype=torch.float32)
    z = torch.randn(tokens, 48 * 128, device="cuda", dtype=DTYPE)
    want = norm(core.to(DTYPE), z.view(tokens, 48, 128)).reshape(tokens, -1)
    _close(gated_rms_norm(core, z.view(tokens, 48, 128), norm.weight, 1e-6, DTYPE), want)
