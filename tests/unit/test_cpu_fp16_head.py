"""The CPU LM head reads a float16 copy of its weight only when float16 holds every weight exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm fp16 kernels"
)


def test_tied_head_uses_fp16_when_the_embedding_is_fp16_exact() -> None:
    embedding = VocabParallelEmbedding(300, 64)
    head = ParallelLMHead(300, 64, tie_to=embedding)
    weight = torch.randn(300, 64).half().float()  # a bf16/fp16 checkpoint's values
    embedding.weight.weight_loader(embedding.weight, weight)
    assert head._fp16_packing is not None  # packed on a thread of its own while the start goes on
    assert head.fp16_weight is not None and head._fp16_packing is None
    hidden = torch.randn(5, 64)
    with torch.inference_mode():
        logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    torch.testing.assert_close(logits, F.linear(hidden, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding(torch.tensor([3, 7])), weight[[3, 7]], rtol=0, atol=0)


def test_float32_weights_keep_the_float32_matmul() -> None:
    head = ParallelLMHead(300, 64)
    weight = torch.randn(300, 64)
    head.weight.weight_loader(head.weight, weight)
    assert head.fp16_weight is None
    hidden = torch.randn(2, 64)
    assert torch.equal(head(hidden), F.linear(hidden, weight))


def test_untied_head_loads_and_packs_its_own_weight() -> None:
    head = ParallelLMHead(128, 64)
    weight = torch.randn(128, 64).half().float()
    head.weight.weight_loader(head.weight, weight)
    assert head.fp16_weight is not None
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), rtol=1e-5, atol=1e-5)
