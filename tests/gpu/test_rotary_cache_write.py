"""The fused rotary + cache-write kernel against the two kernels it replaces (and their references), in
the model dtype and float8, and the attention layer's choice to use it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import reference  # noqa: E402
from fitserve.kernels.cache_write import reshape_and_cache  # noqa: E402
from fitserve.kernels.kv_format import dequantize_kv  # noqa: E402
from fitserve.kernels.norm import rms_norm  # noqa: E402
from fitserve.kernels.rotary import rotary_embedding  # noqa: E402
from fitserve.kernels.rotary_cache_write import rotary_cache_write  # noqa: E402
from fitserve.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from fitserve.layers.rotary_embedding import StepRope  # noqa: E402
from tests.gpu.test_kernels import DEVICE  # noqa: E402
from tests.gpu.test_kernels_fp8 import E4M3, E5M2  # noqa: E402
from tests.unit.model_helpers import ChunkSpec, build_attention_metadata  # noqa: E402

pytestmark = pytest.mark.gpu


def _views(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    """q, k, v as strided views of one packed qkv output, as the model hands them over."""
    num_tokens = qkv.shape[0]
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    return q, k, v


def _packed_qkv(num_tokens: int, q_heads: int, kv_heads: int, head_dim: int):
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=torch.bfloat16)
    return (qkv, *_views(qkv, q_heads, kv_heads, head_dim))


def _cos_sin_cache(head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    return reference.rotary_cos_sin_cache(inv_freq, 4096)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3, E5M2])
@pytest.mark.parametrize(
    "num_tokens,q_heads,kv_heads,head_dim", [(1, 32, 8, 128), (77, 16, 8, 128), (300, 14, 2, 64)]
)
def test_equals_rotary_then_cache_write(
    cache_dtype: torch.dtype, num_tokens: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    qkv, q, k, v = _packed_qkv(num_tokens, q_heads, kv_heads, head_dim)
    expected_qkv = qkv.clone()
    eq, ek, ev = _views(expected_qkv, q_heads, kv_heads, head_dim)
    k_before = k.clone()
    cos_sin = _cos_sin_cache(head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    reference_q, _ = reference.rotary_embedding_reference(positions, q, k, cos_sin)
    slots = torch.randperm(40 * 16)[:num_tokens]
    slots[num_tokens // 2] = -1  # a padding token writes nothing
    slots = slots.to(DEVICE)
    cache = torch.randn(2, 40, 16, kv_heads, head_dim, device=DEVICE).to(cache_dtype)
    expected_cache = cache.clone()
    scales = (0.37, 2.5) if cache_dtype != torch.bfloat16 else (1.0, 1.0)
    rotary_embedding(positions, eq, ek, cos_sin)
    reshape_and_cache(ek, ev, expected_cache, slots, *scales)

    rotary_cache_write(positions, q, k, v, cos_sin, cache, slots, *scales)
    assert torch.equal(q, eq), "q differs from the rotary kernel's"
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8)), "cache bytes differ"
    assert torch.equal(k, k_before), "k itself is left as it was"
    torch.testing.assert_close(q, reference_q, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,head_dim", [(1, 16, 8, 128), (300, 14, 2, 64)])
def test_fused_qk_norm_equals_norms_then_rotary_then_cache_write(
    cache_dtype: torch.dtype, num_tokens: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    """Qwen3's per-head q/k RMSNorm inside the kernel, against the rms_norm kernel on each, then the rest."""
    qkv, q, k, v = _packed_qkv(num_tokens, q_heads, kv_heads, head_dim)
    q_weight = (torch.rand(head_dim, device=DEVICE) + 0.5).bfloat16()
    k_weight = (torch.rand(head_dim, device=DEVICE) + 0.5).bfloat16()
    eps = 1e-6
    cos_sin = _cos_sin_cache(head_dim)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    slots = torch.randperm(40 * 16)[:num_tokens].to(DEVICE)
    cache = torch.zeros(2, 40, 16, kv_heads, head_dim, device=DEVICE).to(cache_dtype)
    expected_cache = cache.clone()
    scales = (0.37, 2.5) if cache_dtype != torch.bfloat16 else (1.0, 1.0)
    normed_q, normed_k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    reference_q, reference_k = reference.rotary_embedding_reference(
        positions,
        reference.rms_norm_reference(q, q_weight, eps),
        reference.rms_norm_reference(k, k_weight, eps),
        cos_sin,
    )
    rotary_embedding(positions, normed_q, normed_k, cos_sin)
    reshape_and_cache(normed_k, v, expected_cache, slots, *scales)

    rotary_cache_write(
        positions, q, k, v, cos_sin, cache, slots, *scales, qk_norm=(q_weight, eps, k_weight, eps)
    )
    # the variance sums in another order than rms_norm's: a bf16 rounding may land one step apart
    torch.testing.assert_close(q, normed_q, atol=2e-2, rtol=2e-2)
    assert (q == normed_q).float().mean() > 0.99
    torch.testing.assert_close(q, reference_q, atol=3e-2, rtol=3e-2)
    written = dequantize_kv(cache, torch.float32, 1.0)
    expected = dequantize_kv(expected_cache, torch.float32, 1.0)
    # one rounding step apart at most (float8 e4m3: 2^-3 of the value)
    step = 2e-2 if cache_dtype == torch.bfloat16 else 0.15
    torch.testing.assert_close(written, expected, atol=step, rtol=step)
    assert (cache.view(torch.uint8) == expected_cache.view(torch.uint8)).float().mean() > 0.99
    keys = written[0].flatten(0, 1)[slots.long()] * scales[0]
    torch.testing.assert_close(
        keys, reference_k.float(), atol=0.1 if cache_dtype == E4M3 else 3e-2, rtol=0.07
    )


def test_refuses_partial_rotary_and_mismatched_cache() -> None:
    _, q, k, v = _packed_qkv(3, 8, 8, 128)
    positions = torch.arange(3, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    cache = torch.zeros(2, 4, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rotary dims 64 do not cover head_dim 128"):
        rotary_cache_write(positions, q, k, v, _cos_sin_cache(64), cache, slots)
    with pytest.raises(ValueError, match=r"expected \[2, num_blocks, block_size, 8, 128\]"):
        rotary_cache_write(positions, q, k, v, _cos_sin_cache(128), cache[:, :, :, :4], slots)
    weight = torch.ones(128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(64,\) and \(128,\) must both be \[head_dim\] = \[128\]"):
        rotary_cache_write(
            positions, q, k, v, _cos_sin_cache(128), cache, slots, qk_norm=(weight[:64], 1e-6, weight, 1e-6)
        )


def test_backend_fuses_full_rotary_only_and_attends_the_same() -> None:
    """A prefill of 3 tokens and a chunk of 2 after 7 cached ones (cache zeros: only order matters)."""
    backend = TritonAttentionBackend()
    head_dim = 128
    positions = torch.tensor([0, 1, 2, 7, 8], device=DEVICE)
    full = StepRope(positions=positions, cos_sin_cache=_cos_sin_cache(head_dim))
    assert backend.fuses_rotary(head_dim, full)
    assert not backend.fuses_rotary(head_dim, StepRope(full.positions, _cos_sin_cache(64)))
    metadata = build_attention_metadata([ChunkSpec(0, 3, [1]), ChunkSpec(7, 2, [2])], 16)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(metadata, name, getattr(metadata, name).to(DEVICE))
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        _, q, k, v = _packed_qkv(5, 16, 8, head_dim)
        cache = torch.zeros(2, 4, 16, 8, head_dim, device=DEVICE, dtype=torch.bfloat16)
        if fused:
            out = backend.forward(q, k, v, cache, metadata, head_dim**-0.5, rope=full)
        else:
            q, k = full.apply(q, k)
            out = backend.forward(q, k, v, cache, metadata, head_dim**-0.5)
        results.append((out, cache))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
