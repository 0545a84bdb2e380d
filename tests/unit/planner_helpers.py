"""Shared by the planner tests: model shapes kept in tests/unit/fixtures/planner/ (config.json only)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from fitserve.planner.hardware import parse_assume_gpus
from fitserve.planner.memory_inputs import MemoryInputs
from fitserve.planner.model_info import ModelInfo
from fitserve.planner.weights import inventory_from_config

FIXTURES = Path(__file__).parent / "fixtures" / "planner"
H100 = "1x79.19@9.0"  # an 80 GB H100 as torch.cuda.mem_get_info reports it


def fixture_path(name: str) -> str:
    return str(FIXTURES / name)


def model_info(name: str) -> ModelInfo:
    config = AutoConfig.from_pretrained(fixture_path(name))
    return ModelInfo.from_hf_config(name, f"fixture {name}", config)


def memory_inputs(name: str, gpus: str = H100, **settings: object) -> MemoryInputs:
    """Inputs with fitserve's defaults on one GPU of `gpus`; `settings` override them."""
    info = model_info(name)
    values: dict[str, object] = {
        "shape": info.shape,
        "weights": inventory_from_config(info.shape),
        "device": parse_assume_gpus(gpus)[0],
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 256,
        "cudagraph_capture_sizes": (1, 2, 4, *range(8, 257, 8)),
    }
    values.update(settings)
    return MemoryInputs(**values)  # type: ignore[arg-type]
