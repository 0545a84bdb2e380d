"""The CPU forms of RMSNorm, rotary embedding and the decoder layer against HF's formulas, bit for bit."""

from __future__ import annotations

import pytest
import torch

from fitserve.layers.attention.metadata import forward_context
from fitserve.layers.cpu.rms_norm import cpu_rms_norm
from fitserve.layers.layernorm import RMSNorm
from fitserve.layers.rotary_embedding import RopeSettings, RotaryEmbedding, apply_rotary_emb
from fitserve.models.decoder_blocks import DecoderLayer
from tests.unit.model_helpers import build_fitserve_model, build_hf_model, tiny_hf_config


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("hidden", [8, 64, 100, 576, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_formula(hidden: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (fitserve's C kernel, tested in test_cpu_elementwise_kernels.py, switched off)."""
    monkeypatch.setenv("FITSERVE_CPU_KERNELS", "0")
    gen = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(hidden, generator=gen))
    for rows, scale in ((1, 1.0), (16, 30.0), (5, 1e-3)):
        x = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype)
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-5))
        normed, summed = norm(x, residual)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, hf_rms_norm(x + residual, norm.weight, 1e-5))


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_together_as_hf_rotates_each(head_dim: int, dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(head_dim, RopeSettings(theta=10_000.0))
    positions = torch.tensor([0, 1, 7, 300, 4095])
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(5, 6, head_dim, generator=gen).to(dtype)
    k = torch.randn(5, 2, head_dim, generator=gen).to(dtype)
    cos, sin = rotary(positions, dtype)  # the [T, head_dim] tables HF's formula takes
    rope = rotary.rope_for_step(positions, dtype)
    both = rope.rotate(torch.cat((q, k), dim=1))
    assert torch.equal(both[:, :6], apply_rotary_emb(q, cos, sin))
    assert torch.equal(both[:, 6:], apply_rotary_emb(k, cos, sin))
    rotated_q, rotated_k = rope.apply(q, k)
    assert torch.equal(rotated_q, both[:, :6]) and torch.equal(rotated_k, both[:, 6:])


def module_path(layer: DecoderLayer, hidden, residual, rope):
    """DecoderLayer.forward as it is written for any device: each block called as a module."""
    if residual is None:
        residual, hidden = hidden, layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    hidden = layer.self_attn(hidden, rope)
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    return layer.mlp(hidden), residual


@pytest.mark.parametrize(
    "architecture,overrides",
    [
        ("LlamaForCausalLM", {}),
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
        ("Qwen3ForCausalLM", {"head_dim": 32}),
    ],
)
def test_decoder_layer_cpu_path_equals_module_path(architecture: str, overrides: dict) -> None:
    config = tiny_hf_config(architecture, **overrides)
    model = build_fitserve_model(config, build_hf_model(config).state_dict()).model
    tokens, positions = torch.tensor([3, 17, 99, 5]), torch.arange(4)
    hidden = model.embed_tokens(tokens)
    rope = model.rotary_emb.rope_for_step(positions, hidden.dtype)
    with torch.no_grad(), forward_context(None, []):
        residual = None
        for layer in model.layers:
            # each path on its own copies: the fused add + norm may work in place
            copies = (hidden.clone(), None if residual is None else residual.clone())
            got = layer(hidden, residual, rope)  # a CPU rope: the CPU path
            want = module_path(layer, *copies, rope)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            hidden, residual = got


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 9, 64)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_cpu_rms_norm_equals_torch_rms_norm(shape: tuple[int, ...], eps: float) -> None:
    torch.manual_seed(len(shape))
    x = torch.randn(shape) * 3
    weight = torch.randn(shape[-1])
    expected = torch.nn.functional.rms_norm(x, (shape[-1],), weight, eps)
    assert torch.equal(cpu_rms_norm(x, weight, eps), expected)
    with torch.inference_mode():  # the constants were made outside inference mode: usable in both
        assert torch.equal(cpu_rms_norm(x, weight, eps), expected)
