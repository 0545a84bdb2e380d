"""tests/fp8_checkpoints.py's fp8 quantization against compressed-tensors' own quantize / dequantize (the
library llm-compressor writes FP8 checkpoints with), for every weight strategy: the same fp8 values and
the same dequantized weights, given the scales the writer stored."""

from __future__ import annotations

import pytest
import torch

from tests.fp8_checkpoints import Fp8Spec, quantize


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_writer_agrees_with_compressed_tensors(strategy) -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize

    torch.manual_seed(0)
    weight = torch.randn(96, 160) * torch.logspace(-2, 0, 96).unsqueeze(1)
    spec = Fp8Spec("ct", strategy, "none", block=(32, 32))
    data, scale, reference = quantize(weight, spec)
    block = [32, 32] if strategy == "block" else None
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, block_structure=block)
    zero = torch.zeros_like(scale, dtype=torch.float8_e4m3fn)
    library = ct_quantize(weight, scale, zero, args, dtype=torch.float8_e4m3fn)
    assert torch.equal(library.float(), data.float())
    restored = ct_dequantize(data, scale, args=args, dtype=torch.float32)
    assert torch.allclose(restored, reference, rtol=0, atol=0)
