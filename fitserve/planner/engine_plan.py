"""The engine's side of the plan: MemoryInputs from a resolved EngineConfig, for sizing the KV cache at
startup and logging planned against measured.

    device = gpu_device_spec(torch.cuda.current_device())
    inputs = inputs_from_engine_config(config, device)
    planned = plan_memory(inputs)                                   # before loading
    measured = plan_memory(inputs, MemoryTerms(weights, activation_peak, graph_pool, non_torch))
    for line in planned_vs_measured(planned, measured): logger.info(line)
"""

from __future__ import annotations

from pathlib import Path

from fitserve.capture_sizes import decode_capture_sizes
from fitserve.config import EngineConfig
from fitserve.kv_layers import cuda_graphs_unsupported
from fitserve.planner.draft_plan import with_draft
from fitserve.planner.formats import canonical_dtype
from fitserve.planner.hardware import DeviceSpec, gpu_device_spec

__all__ = ["gpu_device_spec", "inputs_from_engine_config"]
from fitserve.planner.memory_inputs import MemoryInputs
from fitserve.planner.model_info import weights_inventory
from fitserve.planner.model_shape import ModelShape
from fitserve.planner.weights import WeightInventory


def inputs_from_engine_config(
    config: EngineConfig, device: DeviceSpec, weights: WeightInventory | None = None
) -> MemoryInputs:
    """`weights` defaults to the model folder's safetensors headers (config.json shapes for dummy weights)."""
    model = config.model
    shape = ModelShape.from_hf_config(model.hf_config)
    if weights is None:
        weights = weights_inventory(
            Path(model.model_path), shape, model.hf_config, model.load_format == "dummy"
        )
    on_gpu = device.kind == "cuda"
    compilation = config.compilation
    sizes: tuple[int, ...] = ()
    if on_gpu and not compilation.enforce_eager and not cuda_graphs_unsupported(shape.model_type):
        sizes = decode_capture_sizes(compilation.cudagraph_capture_sizes, config.scheduler.max_num_seqs)
    inputs = MemoryInputs(
        shape=shape,
        weights=weights,
        device=device,
        dtype=canonical_dtype(model.dtype),
        max_model_len=model.max_model_len,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        block_size=config.cache.block_size,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        quantization=config.quantization,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        cpu_offload_gb=config.model.cpu_offload_gb,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        cudagraph_capture_sizes=sizes,
        num_gpu_blocks_override=config.cache.num_gpu_blocks_override,
        cpu_kv_cache_space_gib=config.cache.cpu_kv_cache_space_gib,
        mamba_cache_mode=config.model.mamba_cache_mode if config.cache.enable_prefix_caching else "none",
    )
    return with_draft(inputs, config.speculative, model.trust_remote_code, model.load_format)
