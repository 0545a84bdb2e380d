"""--cpu-offload-gb with an int4 checkpoint: offloaded layers stay int4 in CPU memory (the form they compute
with, not the checkpoint's tensors), run from the shared staging buffer, and compute what the resident
model does. On the CPU device, as tests/unit/test_cpu_offload.py runs the mechanism; the GPU form (the
Triton kernels' layout kept on the host and copied in) is tests/gpu/test_cpu_offload_gpu.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from fitserve.config import ModelConfig
from fitserve.models.loader import load_model
from fitserve.offload_split import GiB
from tests.quant_checkpoints import QuantSpec, write_quantized
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config

PROMPT_IDS = [3, 17, 101, 5, 250, 42, 7, 99, 180, 33]
NUM_LAYERS = 4
DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def _model_config(folder: Path, cpu_offload_gb: float = 0.0, **overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "model": str(folder),
        "model_path": str(folder),
        "model_source": "test",
        "tokenizer": str(folder),
        "hf_config": AutoConfig.from_pretrained(folder),
        "dtype": torch.float32,
        "max_model_len": 512,
        "load_format": "safetensors",
        "seed": 7,
        "cpu_offload_gb": cpu_offload_gb,
    }
    return ModelConfig(**{**fields, **overrides})


def _layer_bytes(layer: torch.nn.Module) -> int:
    tensors = [*layer.parameters(), *layer.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf_config = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=NUM_LAYERS, **DIMS)
    hf_model = build_hf_model(hf_config, seed=5)
    return write_quantized(tmp_path_factory.mktemp("gptq"), hf_model, QuantSpec("gptq", 32))


@pytest.mark.parametrize("layers", [1, 3])
def test_offloaded_int4_layers_stay_int4_and_compute_what_the_resident_model_does(checkpoint, layers) -> None:
    folder = checkpoint.folder
    resident = load_model(_model_config(folder), "cpu")
    layer_bytes = _layer_bytes(resident.model.layers[0])
    offloaded = load_model(_model_config(folder, (layers - 0.5) * layer_bytes / GiB), "cpu")
    offload = offloaded.cpu_offload
    assert [layer.index for layer in offload.layers] == list(range(layers))
    # What is kept in CPU memory is the int4 form the layer computes with (half a byte a weight and its
    # groups' scales), not float32 and not the checkpoint's tensors.
    held = {name for name, _ in offloaded.model.layers[0].named_buffers()}
    assert not any(name.endswith(("qweight", "qzeros")) for name, _ in offloaded.named_parameters())
    assert any("qkv_proj" in name for name in held)
    float_bytes = sum(p.numel() * 4 for p in checkpoint.dequantized_model.model.layers[0].parameters())
    assert offload.offloaded_bytes == sum(layer.nbytes for layer in offload.layers)
    assert offload.offloaded_bytes < layers * float_bytes / 4
    assert offload.host_bytes < 2 * offload.offloaded_bytes + (1 << 20)  # the checkpoint's chunks are gone
    got = PagedTestRunner(offloaded, offloaded.config).step([("seq", PROMPT_IDS)])[0]
    expected = PagedTestRunner(resident, resident.config).step([("seq", PROMPT_IDS)])[0]
    reference = hf_logits(checkpoint.dequantized_model, PROMPT_IDS)
    # Offloaded int4 layers run torch's int4 kernel or the dequantized weight (the C kernel binds its
    # tensors' addresses, which the offload moves); both within the int4 kernels' tolerance of the
    # dequantized float32 model.
    torch.testing.assert_close(got, reference, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2)
    assert got.argmax(-1).tolist() == reference.argmax(-1).tolist()


def test_offloaded_int4_layers_run_from_one_staging_set(checkpoint) -> None:
    folder = checkpoint.folder
    probe = load_model(_model_config(folder), "cpu")
    model = load_model(_model_config(folder, 1.5 * _layer_bytes(probe.model.layers[0]) / GiB), "cpu")
    first, second, resident = (dict(model.model.layers[i].named_buffers()) for i in (0, 1, 2))
    name = next(n for n in first if "qkv_proj" in n)
    assert first[name].data_ptr() == second[name].data_ptr()
    assert all(tensor.data_ptr() != first[name].data_ptr() for tensor in resident.values())
