"""On a GPU the planner counts int4 weights in the form the engine keeps them (kernels/int4_repack.py: codes
padded to 256 per row, a (scale, zero point) pair per group in the activation dtype, split-K counters), not
the checkpoint's packing, and the dequantize scratch buffer quantized layers share: planned with the
70B shape's numbers, --cpu-offload-gb advice that left no room for one request (it counted 0.8 GiB less)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fitserve.kernels.int4_repack import packed_int4_bytes, repack_int4
from fitserve.planner.memory_estimates import DEQUANT_SCRATCH_BYTES, activation_peak_bytes, weight_bytes_total
from fitserve.planner.model_info import inspect_model
from tests.paths import MODELS_DIR
from tests.unit.planner_helpers import memory_inputs

GPTQ_128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


@pytest.mark.parametrize(("k", "n", "group"), [(4096, 6144, 128), (14336, 4096, 64), (320, 48, 32)])
def test_packed_bytes_are_what_the_repack_allocates(k, n, group) -> None:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    groups = -(-k // group)
    packed = repack_int4(codes, torch.rand(n, groups), torch.full((n, groups), 8.0), group, torch.bfloat16)
    tensors = (packed.qweight, packed.scale_zero, packed.counters)
    assert packed_int4_bytes(k, n, group) == sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def gptq_8b(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama-gptq")
    shutil.copytree(MODELS_DIR / "llama-3.1-8b", folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = GPTQ_128
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_gpu_plan_counts_the_repacked_form_and_the_scratch(gptq_8b) -> None:
    weights = inspect_model(str(gptq_8b), load_format="dummy").weights
    # Per layer, K = 4096 for q/k/v (one fused layer, N 6144), o and gate/up (N 28672), K = 14336 for down:
    # the repacked pairs take 4 bytes per group and row against the checkpoint's 2.5 (float16 scale, a
    # packed zero point), less g_idx (4 bytes per input column) the repack does not keep.
    groups_rows = (4096 // 128) * (6144 + 4096 + 28672) + (14336 // 128) * 4096
    g_idx = 4 * (3 * 4096 + 4096 + 2 * 4096 + 14336)
    counters = 4 * 8 * (6144 + 4096 + 28672 + 4096) // 16
    assert weights.gpu_extra_bytes == 32 * (groups_rows * 3 // 2 - g_idx + counters)
    gpu = memory_inputs("llama-3.1-8b", weights=weights)
    as_stored = memory_inputs("llama-3.1-8b", weights=replace(weights, gpu_extra_bytes=0))
    assert weight_bytes_total(gpu) - weight_bytes_total(as_stored) == weights.gpu_extra_bytes
    plain = memory_inputs("llama-3.1-8b")
    assert activation_peak_bytes(gpu) == activation_peak_bytes(plain) + DEQUANT_SCRATCH_BYTES
