"""What differs between devices, behind one small interface: KV sizing and graph capture.

CpuPlatform: the KV pool is --cpu-kv-cache-space GiB of RAM, or, unset, sized to max_model_len within the
RAM available (fitserve/cpu_kv_cache.py, the planner's rule too), unless num_gpu_blocks_override is
given; no graphs.
CudaPlatform: the KV pool is what gpu_memory_utilization leaves after the measured weights, the
activation peak of a dummy step at max_num_batched_tokens, memory outside torch that this engine added
since it started, and the CUDA graph pool (vLLM's accounting); decode steps replay CUDA graphs
unless enforce_eager.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from fitserve.cpu_kv_cache import available_ram_bytes, check_fits_in_ram, engine_cpu_kv_cache_size
from fitserve.worker.cuda_graphs import CudaGraphRunner, default_capture_sizes
from fitserve.worker.piecewise_graphs import PiecewiseGraphRunner, piecewise_capture_sizes

if TYPE_CHECKING:
    from fitserve.worker.model_runner import ModelRunner

logger = logging.getLogger("fitserve")

GiB = 1 << 30
# Reserved for the CUDA graph pools before they are captured (the graphs need the KV cache's addresses,
# so they are captured after it is allocated); the log reports what capture really took. On the 8B
# shape: 0.21 GiB for the decode graphs, 0.17 GiB for the pieces of steps with prompt tokens.
CUDA_GRAPH_RESERVE_BYTES = 512 << 20


class Platform(Protocol):
    def determine_num_blocks(self, runner: ModelRunner) -> int: ...

    def make_graph_runner(self, runner: ModelRunner) -> CudaGraphRunner | None: ...

    def make_piecewise_runner(self, runner: ModelRunner) -> PiecewiseGraphRunner | None: ...


class CpuPlatform:
    def determine_num_blocks(self, runner: ModelRunner) -> int:
        cache = runner.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        # Read now, with the weights loaded: what is left for the KV cache and the steps.
        available = available_ram_bytes()
        check_fits_in_ram(cache.cpu_kv_cache_space_gib, available)
        size = engine_cpu_kv_cache_size(runner.config, available)
        logger.info("%s", size.log_line())
        return size.num_blocks

    def make_graph_runner(self, runner: ModelRunner) -> CudaGraphRunner | None:
        return None

    def make_piecewise_runner(self, runner: ModelRunner) -> PiecewiseGraphRunner | None:
        return None


class CudaPlatform:
    """Memory outside torch is counted from a baseline taken when the platform starts (before the
    weights load, after this process's CUDA context exists), as vLLM does: memory other processes hold
    is not this engine's, so two engines can share a GPU at 0.45 each."""

    def __init__(self) -> None:
        self.weights_bytes = 0
        free, total = torch.cuda.mem_get_info()
        self.baseline_used = total - free
        self.baseline_reserved = torch.cuda.memory_reserved()
        # Tensors this process already held (e.g. another engine not yet collected) are not ours either.
        self.baseline_allocated = torch.cuda.memory_allocated()

    def determine_num_blocks(self, runner: ModelRunner) -> int:
        config = runner.config
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated() - self.baseline_allocated
        torch.cuda.reset_peak_memory_stats()
        scratch_bytes = runner.profile_run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch_bytes - self.baseline_allocated
        free_now, _ = torch.cuda.mem_get_info()
        used_since_start = (total - free_now) - self.baseline_used
        non_torch = max(0, used_since_start - (torch.cuda.memory_reserved() - self.baseline_reserved))
        activation = peak - weights
        graph_reserve = 0 if config.compilation.enforce_eager else CUDA_GRAPH_RESERVE_BYTES
        budget = total * config.cache.gpu_memory_utilization
        kv_bytes = budget - weights - activation - non_torch - graph_reserve
        torch.cuda.empty_cache()
        self.weights_bytes = weights
        self._log_planned_vs_measured(config, weights, activation, graph_reserve, non_torch)
        logger.info(
            "Memory profiling: total %.2f GiB x utilization %.2f = %.2f GiB; weights %.2f GiB, "
            "activation peak %.2f GiB, non-torch %.2f GiB, CUDA graph reserve %.2f GiB",
            total / GiB,
            config.cache.gpu_memory_utilization,
            budget / GiB,
            weights / GiB,
            activation / GiB,
            non_torch / GiB,
            graph_reserve / GiB,
        )
        logger.info("Available KV cache memory: %.2f GiB", max(kv_bytes, 0) / GiB)
        override = config.cache.num_gpu_blocks_override
        if override is not None:
            return override
        num_blocks = int(kv_bytes // runner.kv_bytes_per_block())
        if num_blocks < 2:
            raise ValueError(
                "no memory is left for the KV cache: "
                f"gpu_memory_utilization={config.cache.gpu_memory_utilization} gives {budget / GiB:.2f} GiB, "
                f"of which weights take {weights / GiB:.2f} GiB and the activation peak at "
                f"max_num_batched_tokens={config.scheduler.max_num_batched_tokens} takes "
                f"{activation / GiB:.2f} GiB: raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens, or use a smaller model"
            )
        return num_blocks

    @staticmethod
    def _log_planned_vs_measured(config, weights: int, activation: int, graphs: int, non_torch: int) -> None:
        """The planner's numbers (fitserve plan) beside what profiling measured, term by term."""
        from fitserve.planner.engine_plan import gpu_device_spec, inputs_from_engine_config
        from fitserve.planner.memory import MemoryTerms, plan_memory, planned_vs_measured

        inputs = inputs_from_engine_config(config, gpu_device_spec(torch.cuda.current_device()))
        planned = plan_memory(inputs)
        measured = plan_memory(inputs, MemoryTerms(weights, activation, graphs, non_torch))
        for line in planned_vs_measured(planned, measured):
            logger.info("Plan vs measured: %s", line)

    def make_graph_runner(self, runner: ModelRunner) -> CudaGraphRunner | None:
        config = runner.config
        if config.compilation.enforce_eager:
            return None
        sizes = list(config.compilation.cudagraph_capture_sizes) or default_capture_sizes(
            config.scheduler.max_num_seqs
        )
        sizes = sorted(s for s in sizes if s <= config.scheduler.max_num_seqs) or [1]
        mc = config.model
        graph_runner = CudaGraphRunner(
            model=runner.model,
            kv_caches=runner.kv_caches,
            capture_sizes=sizes,
            max_blocks_per_seq=-(-mc.max_model_len // config.cache.block_size),
            max_model_len=mc.max_model_len,
            hidden_size=mc.hf_config.hidden_size,
            dtype=mc.dtype,
            device=runner.device,
        )
        seconds, used = graph_runner.capture()
        logger.info("Graph capturing finished in %.0f secs, took %.2f GiB", seconds, used / GiB)
        return graph_runner

    def make_piecewise_runner(self, runner: ModelRunner) -> PiecewiseGraphRunner | None:
        """Graphs for steps with prompt tokens (worker/piecewise_graphs.py), unless eager mode, a
        model without forward_in_pieces, or CPU-offloaded layers (whose weights stream in through
        hooks on the whole layer, which the pieces do not call)."""
        config = runner.config
        mc = config.model
        if (
            config.compilation.enforce_eager
            or not hasattr(runner.model, "forward_in_pieces")
            or mc.cpu_offload_gb > 0
        ):
            return None
        piecewise = PiecewiseGraphRunner(
            model=runner.model,
            kv_caches=runner.kv_caches,
            sizes=piecewise_capture_sizes(config.scheduler.max_num_batched_tokens),
            num_heads=runner.model.attention_layers[0].num_heads,
            head_dim=mc.head_dim,
            dtype=mc.dtype,
            device=runner.device,
        )
        seconds, used = piecewise.capture()
        logger.info(
            "Piecewise graphs for steps of up to %d tokens captured in %.1f secs, took %.2f GiB",
            piecewise.max_tokens,
            seconds,
            used / GiB,
        )
        return piecewise


def make_platform(device: torch.device) -> Platform:
    if device.type == "cuda":
        return CudaPlatform()
    return CpuPlatform()
