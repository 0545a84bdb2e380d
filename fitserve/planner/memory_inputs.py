"""What the memory plan is computed from: `MemoryInputs` (the model's shape and weights, the device, the
resolved settings), a speculative draft model's `DraftFootprint`, and `with_settings` to vary them.

The plan itself is planner/memory.py; the estimates of its terms are planner/memory_estimates.py and
planner/kv_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitserve.config import DEFAULT_GPU_MEMORY_UTILIZATION
from fitserve.planner.hardware import DeviceSpec
from fitserve.planner.model_shape import ModelShape
from fitserve.planner.weights import WeightInventory


@dataclass(frozen=True)
class DraftFootprint:
    """A draft model of speculative decoding (method draft_model) on the target's device: its weights,
    and its keys and values per token, held beside the target's in a pool of as many blocks."""

    name: str
    weight_bytes: int
    kv_elements_per_token: int


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the plan depends on; the settings are resolved (no "auto" except kv_cache_dtype)."""

    shape: ModelShape
    weights: WeightInventory
    device: DeviceSpec  # the GPU each tensor-parallel rank plans for (the smallest), or the CPU
    dtype: str  # "bfloat16" | "float16" | "float32"
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages, each of tensor_parallel_size ranks (distributed/pipeline.py)
    cpu_offload_gb: float = 0.0  # per GPU, as vLLM's --cpu-offload-gb
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    cudagraph_capture_sizes: tuple[int, ...] = ()  # () = eager
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_space_gib: float | None = None  # None: sized by fitserve/cpu_kv_cache.py's rule
    # --mamba-cache-mode as resolved ("none" without prefix caching): a hybrid's state snapshots
    mamba_cache_mode: str = "none"
    draft: DraftFootprint | None = None  # --speculative-config method draft_model
    # --speculative-config's k (any method): a hybrid model's state pool holds k more rows per request
    speculative_tokens: int = 0

    @property
    def on_gpu(self) -> bool:
        return self.device.kind == "cuda"

    @property
    def world_size(self) -> int:
        """Ranks (GPUs, or CPU processes) of the engine: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def with_settings(inputs: MemoryInputs, **changes: object) -> MemoryInputs:
    """`inputs` with some settings changed (a new frozen object)."""
    return replace(inputs, **changes)  # type: ignore[arg-type]
