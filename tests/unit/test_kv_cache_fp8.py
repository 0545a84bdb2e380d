"""The float8 KV cache on the CPU: writes and reads with scales, the CPU backend against the kernels'
torch references, checkpoint scales, and a tiny model's logits against a float32 cache."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels import reference
from fitserve.kernels.kv_format import dequantize_kv, quantize_kv, write_kv_cache
from fitserve.layers.attention.cpu_backend import CpuAttentionBackend
from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import forward_context
from fitserve.models.weights import take_kv_scales
from tests.unit.model_helpers import (
    ChunkSpec,
    PagedTestRunner,
    attention_reference_from_metadata,
    build_attention_metadata,
    build_fitserve_model,
    build_hf_model,
    tiny_hf_config,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Round to nearest: half an ulp relative (3 and 2 mantissa bits), and half the smallest subnormal absolute.
TOLERANCE = {E4M3: dict(rtol=2**-4, atol=2**-10), E5M2: dict(rtol=2**-3, atol=2**-17)}


def read_kv_cache(kv_cache: torch.Tensor, slots: torch.Tensor, k_scale: float, v_scale: float):
    """The keys and values at flat slots, dequantized to float32 (what attention reads)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(torch.uint8).view(2, -1, num_kv_heads, head_dim)[:, slots].view(kv_cache.dtype)
    return dequantize_kv(flat[0], torch.float32, k_scale), dequantize_kv(flat[1], torch.float32, v_scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.05, 3.0)])
def test_write_then_read_round_trips_within_float8_tolerance(dtype, kv_scales) -> None:
    k_scale, v_scale = kv_scales
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, 6, 8, 2, 16, dtype=dtype)
    k = 4 * k_scale * torch.randn(20, 2, 16)  # well inside the float8 range once divided by the scale
    v = 4 * v_scale * torch.randn(20, 2, 16)
    slots = torch.randperm(48)[:20]
    write_kv_cache(kv_cache, k, v, slots, k_scale, v_scale)
    k_read, v_read = read_kv_cache(kv_cache, slots, k_scale, v_scale)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(k_read, k, rtol=tolerance["rtol"], atol=tolerance["atol"] * k_scale)
    torch.testing.assert_close(v_read, v, rtol=tolerance["rtol"], atol=tolerance["atol"] * v_scale)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert not kv_cache.view(torch.uint8).view(2, 48, -1)[:, untouched].any()  # other slots stay zero


def test_scales_divide_on_write_and_clamp_to_the_float8_range() -> None:
    kv_cache = torch.zeros(2, 2, 4, 1, 4, dtype=E4M3)
    k = torch.tensor([[[1.0, -3.0, 10.0, 2000.0]]])  # 2000 / 2 = 1000 is above e4m3's 448
    v = torch.tensor([[[0.5, 6.0, -5000.0, 0.0]]])
    write_kv_cache(kv_cache, k, v, torch.tensor([5]), k_scale=2.0, v_scale=1.0)
    stored = kv_cache.view(2, 8, 1, 4)[:, 5].float()
    assert stored[0].tolist() == [[0.5, -1.5, 5.0, 448.0]]  # a scale of 2 halves the stored value
    assert stored[1].tolist() == [[0.5, 6.0, -448.0, 0.0]]
    k_read, v_read = read_kv_cache(kv_cache, torch.tensor([5]), 2.0, 1.0)
    assert k_read.tolist() == [[[1.0, -3.0, 10.0, 896.0]]]  # the clamp is at 448 * scale
    assert v_read.tolist() == [[[0.5, 6.0, -448.0, 0.0]]]


def test_the_attention_layer_passes_its_scales_to_the_backend() -> None:
    layer = Attention(num_heads=4, head_dim=8, scale=8**-0.5, num_kv_heads=2)
    layer.k_scale, layer.v_scale = 2.0, 0.25
    kv_cache = torch.zeros(2, 2, 16, 2, 8, dtype=E4M3)
    metadata = build_attention_metadata([ChunkSpec(0, 5, [1])], 16)
    k = torch.tensor([1.0, -3.0, 0.5, 6.0, 8.0]).repeat_interleave(16).reshape(5, 16)
    with forward_context(metadata, [kv_cache]):
        layer(torch.randn(5, 32), k, k)
    stored = kv_cache[:, 1, :5].float().reshape(2, 5, 16)
    assert torch.equal(stored[0], k / 2.0) and torch.equal(stored[1], k * 4.0)


def test_a_cache_in_the_model_dtype_ignores_the_scales() -> None:
    x = torch.randn(3, 2, 8)
    assert torch.equal(quantize_kv(x, torch.float32, 4.0), x)
    assert torch.equal(dequantize_kv(x.to(torch.bfloat16), torch.float32, 4.0), x.to(torch.bfloat16).float())


def mixed_step(num_kv_heads: int, head_dim: int, block_size: int):
    """A step of a prefill from scratch, a chunk over a cached prefix and two decodes, with its q/k/v."""
    chunks = [
        ChunkSpec(0, 23, [7, 2]),
        ChunkSpec(19, 30, [4, 9, 0, 5][: -(-49 // block_size)]),
        ChunkSpec(40, 1, [1, 3, 6]),
        ChunkSpec(8, 1, [8]),
    ]
    metadata = build_attention_metadata(chunks, block_size)
    num_tokens = sum(c.query_len for c in chunks)
    q = torch.randn(num_tokens, 2 * num_kv_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    return metadata, q, k, v


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_reference_backend_matches_the_kernel_references(dtype) -> None:
    """The CPU backend and fitserve.kernels.reference (what the Triton kernels are tested against) store
    the same bytes and attend to the same values over a float8 cache with scales."""
    torch.manual_seed(1)
    num_kv_heads, head_dim, block_size, k_scale, v_scale = 2, 16, 16, 0.7, 1.9
    metadata, q, k, v = mixed_step(num_kv_heads, head_dim, block_size)
    cache = (torch.randn(2, 10, block_size, num_kv_heads, head_dim) * 2).to(dtype)  # the cached prefixes
    expected_cache = cache.clone()
    out = CpuAttentionBackend().forward(q, k, v, cache, metadata, 0.25, k_scale, v_scale)
    reference.reshape_and_cache_reference(k, v, expected_cache, metadata.slot_mapping, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    expected = attention_reference_from_metadata(q, expected_cache, metadata, 0.25, k_scale, v_scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # ... and the scales matter: without them the same bytes attend differently
    unscaled = attention_reference_from_metadata(q, expected_cache, metadata, 0.25)
    assert (unscaled - expected).abs().max() > 0.1


def test_float8_attention_is_close_to_float32_attention() -> None:
    torch.manual_seed(2)
    metadata, q, k, v = mixed_step(2, 32, 16)
    prefix = torch.randn(2, 10, 16, 2, 32)
    outputs = {}
    for dtype in (torch.float32, E4M3):
        cache = prefix.to(dtype)
        outputs[dtype] = CpuAttentionBackend().forward(q, k, v, cache, metadata, 32**-0.5)
    error = (outputs[E4M3] - outputs[torch.float32]).norm() / outputs[torch.float32].norm()
    assert error < 0.05


class FakeAttention:
    def __init__(self) -> None:
        self.k_scale = self.v_scale = 1.0


def test_checkpoint_scales_are_taken_out_and_set_per_layer() -> None:
    layers = [FakeAttention(), FakeAttention(), FakeAttention()]
    weights = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.0.self_attn.q_proj.weight", torch.ones(2, 2)),
        ("model.layers.0.self_attn.v_scale", torch.tensor([2.0], dtype=torch.bfloat16)),
        ("model.layers.2.self_attn.kv_scale", torch.tensor(0.25)),
        ("model.layers.1.self_attn.attn.v_scale", torch.tensor(3.0)),
    ]
    passed = list(take_kv_scales(weights, layers))
    assert [name for name, _ in passed] == ["model.layers.0.self_attn.q_proj.weight"]
    assert [(layer.k_scale, layer.v_scale) for layer in layers] == [(0.5, 2.0), (1.0, 3.0), (0.25, 0.25)]


@pytest.mark.parametrize(
    ("name", "tensor", "message"),
    [
        ("model.layers.0.self_attn.k_scale", torch.tensor([1.0, 2.0]), "holds 2 value"),
        ("model.layers.0.self_attn.v_scale", torch.tensor(0.0), "one positive, finite number"),
        ("model.layers.0.self_attn.kv_scale", torch.tensor(float("inf")), "one positive, finite number"),
        ("model.layers.5.self_attn.k_scale", torch.tensor(1.0), "the model has 2 attention layers"),
    ],
)
def test_bad_checkpoint_scales_are_refused(name: str, tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(take_kv_scales([(name, tensor)], [FakeAttention(), FakeAttention()]))


@pytest.mark.parametrize(
    ("architecture", "dtype", "max_error", "min_agreement"),
    [
        ("LlamaForCausalLM", E4M3, 0.05, 0.85),
        ("Qwen3ForCausalLM", E4M3, 0.05, 0.85),
        ("Qwen2ForCausalLM", E5M2, 0.08, 0.8),
    ],
)
def test_tiny_model_logits_with_a_float8_cache(architecture, dtype, max_error, min_agreement) -> None:
    """Prefill chunks, then decode steps, teacher-forced: logits near the float32 cache's, same argmax
    at most positions (a random tiny model has near-ties that float8 rounding can flip)."""
    config = tiny_hf_config(architecture)
    model = build_fitserve_model(config, build_hf_model(config, seed=0).state_dict())
    token_ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for cache_dtype in (torch.float32, dtype):
        runner = PagedTestRunner(model, config, dtype=cache_dtype)
        steps = [runner.step([("a", token_ids[:12])])[0], runner.step([("a", token_ids[12:20])])[0]]
        steps += [runner.step([("a", [token])])[0] for token in token_ids[20:]]
        logits[cache_dtype] = torch.cat(steps)
    exact, approx = logits[torch.float32], logits[dtype]
    assert ((approx - exact).norm() / exact.norm()).item() < max_error
    assert (approx.argmax(-1) == exact.argmax(-1)).float().mean().item() >= min_agreement
