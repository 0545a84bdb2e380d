"""The "Model loading took X GiB" figure: every storage once, plus the CPU layers' packed copies; and the
plan's weights for the default model (int4 matrices, a float16 head copy) against it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fitserve.args import EngineArgs
from fitserve.layers.cpu.int4_linear import kernel_available
from fitserve.models.loader import load_model
from fitserve.planner.engine_plan import inputs_from_engine_config
from fitserve.planner.hardware import DeviceSpec
from fitserve.planner.memory import plan_memory
from fitserve.planner.model_info import inspect_model
from fitserve.planner.resolve import create_engine_config
from fitserve.planner.weights import INT4_BYTES_PER_WEIGHT, converted_gguf_int4_type
from fitserve.worker.model_runner import loaded_model_bytes
from tests.unit.default_model_fixture import DefaultModelCache


def test_counts_shared_storage_once_and_adds_packed_copies() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(100, 8)
    model.head = nn.Linear(8, 100, bias=False)
    model.head.weight = model.embed.weight  # tied: one storage
    model.proj = nn.Linear(8, 8)
    model.proj.register_buffer("table", torch.zeros(10, dtype=torch.float64))
    expected = (100 * 8 + 8 * 8 + 8) * 4 + 10 * 8
    assert loaded_model_bytes(model) == expected
    model.proj.packed_copy_bytes = 8 * 8 * 2  # a float16 copy held outside parameters
    assert loaded_model_bytes(model) == expected + 128


def test_views_of_one_buffer_count_the_buffer_once() -> None:
    buffer = torch.zeros(1000)
    model = nn.Module()
    model.a = nn.Parameter(buffer[:10], requires_grad=False)
    model.b = nn.Parameter(buffer[10:30], requires_grad=False)
    assert loaded_model_bytes(model) == 1000 * 4


@pytest.mark.network
@pytest.mark.skipif(not kernel_available(), reason="no CPU int4 kernel")
@pytest.mark.parametrize("c_kernels", ["1", "0"])  # fitserve's C int4 kernel, or torch's (+ float16 copies)
def test_the_plan_counts_the_default_models_weights_as_the_cpu_engine_keeps_them(
    default_model_cache: DefaultModelCache, monkeypatch: pytest.MonkeyPatch, c_kernels: str
) -> None:
    monkeypatch.setenv("FITSERVE_CPU_KERNELS", c_kernels)
    folder = default_model_cache.resolved.model_path
    weights = inspect_model(folder).weights  # what `fitserve plan` reads: no value, only headers and records
    assert weights.cpu_forms.gguf_type == "Q4_1" and weights.cpu_forms.fp16_head
    assert weights.cpu_forms.int4_params == weights.counts.linear  # every decoder matrix of SmolLM2-135M
    config = create_engine_config(EngineArgs(model=folder, device="cpu"))
    cpu = DeviceSpec("cpu", 0, "CPU", 16 * 2**30, 16 * 2**30)
    planned = plan_memory(inputs_from_engine_config(config, cpu, weights)).terms.weights
    loaded = loaded_model_bytes(load_model(config.model, torch.device("cpu")))
    # 0.22 GiB with the C kernel (0.625 byte a weight), 0.42 with torch's (and its float16 copies); float32
    # everywhere would be 0.50. Measured: 128 bytes apart (small buffers the plan does not count).
    assert planned == pytest.approx(loaded, rel=1e-3)
    per_weight = weights.cpu_forms.int4_bytes_per_weight
    assert per_weight == (INT4_BYTES_PER_WEIGHT if c_kernels == "1" else INT4_BYTES_PER_WEIGHT + 2)
    if c_kernels == "1":
        assert planned / 2**30 == pytest.approx(0.22, abs=0.005)


def test_only_a_q4_0_or_q4_1_conversion_counts_as_int4(tmp_path: Path) -> None:
    (tmp_path / "fitserve_cache_entry.json").write_text('{"source_gguf": "/x/model.Q8_0.gguf"}')
    assert converted_gguf_int4_type(tmp_path) is None
    (tmp_path / "fitserve_cache_entry.json").write_text(
        '{"origin": "pkg-0.1-py3-none-any.whl:pkg/Some-Model.Q4_0.gguf", "source_gguf": "/tmp/x/a.gguf"}'
    )
    assert converted_gguf_int4_type(tmp_path) == "Q4_0"
    (tmp_path / "fitserve_cache_entry.json").write_text('{"source_gguf": "/m/llama-3-8b-q4_k_m.gguf"}')
    assert converted_gguf_int4_type(tmp_path) is None  # a K-quant: not groups of 32 with one scale
    assert converted_gguf_int4_type(tmp_path / "absent") is None


def test_the_recorded_matrix_types_win_over_the_file_name(tmp_path: Path) -> None:
    record = '{"source_gguf": "/x/model.Q4_1.gguf", "gguf_matrix_types": {"Q4_1": 210, "Q8_0": 1}}'
    (tmp_path / "fitserve_cache_entry.json").write_text(record)
    assert converted_gguf_int4_type(tmp_path) == "Q4_1"
    # A file named Q4_0 whose matrices are mostly Q6_K (a mixed quantization) keeps no int4 groups of 32.
    record = '{"source_gguf": "/x/model.Q4_0.gguf", "gguf_matrix_types": {"Q4_0": 20, "Q6_K": 190}}'
    (tmp_path / "fitserve_cache_entry.json").write_text(record)
    assert converted_gguf_int4_type(tmp_path) is None
