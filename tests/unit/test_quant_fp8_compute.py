"""The fp8 forms (layers/quantization/fp8_weight.py, fp8_compute.py) on the CPU:

- quantize_fp8 against a float reference, and the weight-only path (chunked
  dequantize per call) against dequantize-then-matmul, exactly in float32;
- the W8A8 path (torch._scaled_mm with row-wise scales, which torch also runs on the CPU) against the
  HF model holding the dequantized weights whose projections' inputs are fake-quantized to fp8 by
  compressed-tensors' own function (per token, or the static input_scale): logits within 1e-4 of the
  largest (torch's CPU _scaled_mm accumulates and returns float32; CUDA's returns bfloat16, whose rounding
  flips later fp8 roundings, so there only per-layer comparisons are tight: tests/gpu), while weight-only
  logits differ from that by several percent (the activations' fp8 rounding): the test tells them apart.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fitserve.layers.quantization.fp8_compute as fp8_compute
from fitserve.layers.quantization.fp8_weight import (
    FP8_MAX,
    Fp8Weight,
    dequantize,
    quantize_fp8,
    random_fp8_weight,
)
from tests.fp8_checkpoints import Fp8Spec, write_fp8
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config
from tests.unit.test_quant_fp8_formats import DIMS, FUSED, TOKENS, load_capturing, paths


def test_quantize_fp8_is_round_to_nearest_per_row_and_per_group() -> None:
    weight = torch.randn(40, 100) * torch.logspace(-3, 1, 40).unsqueeze(1)
    for group in (None, 32):
        fp8 = quantize_fp8(weight, group)
        fp8.check()
        expected_groups = 1 if group is None else 4
        assert fp8.scale.shape == (40, expected_groups)
        assert float(fp8.data.float().abs().max()) == FP8_MAX  # each row's (group's) amax maps to 448
        relative = (dequantize(fp8) - weight).abs() / weight.abs().clamp_min(
            1e-3 * weight.abs().max(1, True)[0]
        )
        assert float(relative.max()) <= 2**-4 + 1e-6  # e4m3: 3 mantissa bits, half a step of rounding


class _Layer(nn.Module):
    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_weight_only_path_equals_dequantize_then_matmul(group, rows, monkeypatch) -> None:
    monkeypatch.setitem(fp8_compute.CHUNK_ELEMENTS, "cpu", 96 * 16)  # 16 rows a chunk: many chunks
    generator = torch.Generator().manual_seed(1)
    weight = random_fp8_weight(72, 96, group, 0.05, generator)
    layer = _Layer(torch.randn(72))
    method = fp8_compute.make_fp8_runnable(
        layer, weight, None, torch.float32, "dynamic", "test", torch.device("cpu")
    )
    assert method.path == "weight-only"
    x = torch.randn(rows, 96)
    expected = x @ dequantize(weight).t() + layer.bias
    assert torch.allclose(method.apply(layer, x), expected, rtol=1e-5, atol=1e-5)


def test_w8a8_path_matches_per_token_quantized_reference(monkeypatch) -> None:
    monkeypatch.setattr(fp8_compute, "w8a8_supported", lambda device: True)
    generator = torch.Generator().manual_seed(2)
    weight = random_fp8_weight(64, 128, None, 0.05, generator)
    layer = _Layer(None)
    method = fp8_compute.make_fp8_runnable(
        layer, weight, None, torch.bfloat16, "dynamic", "test", torch.device("cpu")
    )
    assert method.path == "w8a8"
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    x_q, x_scale = fp8_compute.quantize_activations(x, None)
    expected = (x_q.float() * x_scale) @ dequantize(weight).t()
    got = method.apply(layer, x).float()
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-2


def fake_quantized_inputs(model: nn.Module, checkpoint) -> list:
    """Forward pre-hooks on the HF model's quantized projections that fake-quantize their inputs to fp8
    with compressed-tensors' own function: per token (dynamic) or with the checkpoint's input_scale."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    static = checkpoint.spec.activations == "static"
    args = QuantizationArgs(
        num_bits=8, type="float", strategy="tensor" if static else "token", dynamic=not static
    )
    handles = []
    for name, module in model.named_modules():
        if name not in checkpoint.reference:
            continue

        def hook(module, inputs, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            if static:  # a fused layer quantizes its input once, with its projections' largest scale
                prefix, _, leaf = name.rpartition(".")
                group = next((parts for parts in FUSED.values() if leaf in parts), (leaf,))
                scales = [checkpoint.tensors[f"{prefix}.{part}.input_scale"] for part in group]
                scale = torch.stack(scales).max().reshape(1, 1)
            else:
                scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
            zero = torch.zeros_like(scale, dtype=torch.float8_e4m3fn)
            return (fake_quantize(x, scale, zero, args).reshape(inputs[0].shape),)

        handles.append(module.register_forward_pre_hook(hook))
    return handles


@pytest.mark.parametrize(
    "spec",
    [
        Fp8Spec("ct", "channel", "dynamic"),
        Fp8Spec("ct", "tensor", "static"),
        Fp8Spec("hf", "tensor", "static"),
    ],
    ids=lambda s: s.name,
)
def test_w8a8_logits_match_fp8_fake_quantized_activations(spec, tmp_path, monkeypatch) -> None:
    pytest.importorskip("compressed_tensors")
    monkeypatch.setattr(fp8_compute, "w8a8_supported", lambda device: True)
    monkeypatch.setattr(fp8_compute, "W8A8_DTYPES", (torch.float32,))  # a float32 model on the CPU
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=3)
    checkpoint = write_fp8(tmp_path / spec.name, hf_model, spec)
    model, _, config = load_capturing(checkpoint.folder, monkeypatch)
    assert paths(model) == {"w8a8"}
    weight_only = hf_logits(checkpoint.dequantized_model, TOKENS)
    handles = fake_quantized_inputs(checkpoint.dequantized_model, checkpoint)
    expected = hf_logits(checkpoint.dequantized_model, TOKENS)
    for handle in handles:
        handle.remove()
    got = PagedTestRunner(model, config).step([("seq", TOKENS)])[0]
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) / scale < 1e-4
    assert float((weight_only - expected).abs().max()) / scale > 2e-2  # the test can tell the paths apart


def test_w8a8_checkpoint_on_the_cpu_runs_weight_only_and_says_so(tmp_path, monkeypatch, caplog) -> None:
    fp8_compute._announced.clear()
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=3)
    checkpoint = write_fp8(tmp_path / "w8a8", hf_model, Fp8Spec("hf", "block", "dynamic"))
    with caplog.at_level(logging.INFO, logger="fitserve"):
        model, _, _ = load_capturing(checkpoint.folder, monkeypatch)
    assert paths(model) == {"weight-only"}
    assert "W8A8 falls back to weight-only (float32 activations) on the CPU" in caplog.text


def test_weight_check_names_the_field() -> None:
    data = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"Fp8Weight.scale is torch.float32 \(4, 3\), not float32 \(4, 2\)"):
        Fp8Weight(data, torch.ones(4, 3), 32).check()


def test_block_scales_are_recovered_only_from_whole_128_blocks() -> None:
    from fitserve.layers.quantization.fp8_block import block_scales, quantize_activation_groups

    generator = torch.Generator().manual_seed(3)
    weight = random_fp8_weight(256, 384, 128, 0.05, generator)  # per-row scales: not 128-row blocks
    assert block_scales(weight) is None
    blocks = torch.rand(2, 3) + 0.5
    whole = Fp8Weight(weight.data, blocks.repeat_interleave(128, 0), 128)
    assert torch.equal(block_scales(whole), blocks)
    x = torch.randn(5, 384)
    x_q, x_scale = quantize_activation_groups(x)
    assert x_scale.shape == (5, 3) and x_scale.stride() == (1, 5)  # token-major, as cuBLASLt wants
    restored = x_q.float().view(5, 3, 128) * x_scale.unsqueeze(-1)
    assert torch.allclose(restored.view(5, 384), x, rtol=2**-4, atol=0)


def test_a_block_scale_covers_128_rows_across_chunk_edges(monkeypatch) -> None:
    """quantize_fp8 with group_rows: one scale per [128, 128] block (its amax / 448) repeated over the
    block's rows, also when the rows are quantized in chunks (here 200 rows a chunk, cut to 128) and the
    last block is partial; --load-format dummy draws block-scaled layers this way, so they take the
    block-scaled GEMM (block_scales) as a checkpoint's do."""
    from fitserve.layers.quantization import fp8_weight
    from fitserve.layers.quantization.fp8_block import block_scales

    monkeypatch.setattr(fp8_weight, "_CHUNK_ELEMENTS", 200 * 256)
    weight = torch.randn(300, 256, generator=torch.Generator().manual_seed(5))
    quantized = quantize_fp8(weight, 128, group_rows=128)
    for first in range(0, 300, 128):
        block = weight[first : first + 128].view(-1, 2, 128).abs().amax(dim=(0, 2)) / 448
        assert torch.equal(quantized.scale[first : first + 128], block.expand(min(128, 300 - first), 2))
    assert torch.allclose(dequantize(quantized), weight, rtol=2**-3, atol=2e-3 * 8)
    generator = torch.Generator().manual_seed(3)
    assert block_scales(random_fp8_weight(256, 384, 128, 0.05, generator, group_rows=128)) is not None
