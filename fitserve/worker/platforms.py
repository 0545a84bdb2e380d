"""What differs between devices, behind one small interface: KV sizing and graph capture.

Both size the KV cache with the planner's formula (fitserve/planner/memory.py), fed what this process
measured, so `fitserve plan`, the startup log and the server read one memory model:
CpuPlatform: the RAM available now that the weights are loaded; the pool is --cpu-kv-cache-space GiB,
or, unset, sized to max_model_len within that RAM (fitserve/cpu_kv_cache.py), unless
num_gpu_blocks_override is given; no graphs.
CudaPlatform: the pool is what gpu_memory_utilization leaves after the measured weights, the activation
peak of a dummy step at max_num_batched_tokens, memory outside torch that this engine added since it
started, and the CUDA graph reserve (vLLM's accounting); decode steps replay CUDA graphs unless
enforce_eager.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Protocol

import torch

from fitserve.capture_sizes import decode_capture_sizes, piecewise_capture_sizes
from fitserve.cpu_kv_cache import available_ram_bytes, check_fits_in_ram
from fitserve.distributed.parallel_state import tp
from fitserve.planner.engine_plan import inputs_from_engine_config
from fitserve.planner.hardware import DeviceSpec, cpu_device, gpu_device_spec, probe_host
from fitserve.planner.memory import MemoryPlan, MemoryTerms, plan_memory, planned_vs_measured
from fitserve.planner.memory_estimates import CPU_RUNTIME_OVERHEAD_BYTES, cuda_graph_bytes
from fitserve.worker.cuda_graphs import CudaGraphRunner
from fitserve.worker.piecewise_graphs import PiecewiseGraphRunner

if TYPE_CHECKING:
    from fitserve.config import EngineConfig
    from fitserve.worker.model_runner import ModelRunner

logger = logging.getLogger("fitserve")

GiB = 1 << 30


class Platform(Protocol):
    def size_kv_cache(self, runner: ModelRunner) -> MemoryPlan: ...

    def make_graph_runner(self, runner: ModelRunner) -> CudaGraphRunner | None: ...

    def make_piecewise_runner(self, runner: ModelRunner) -> PiecewiseGraphRunner | None: ...


def _sized_from_measurements(
    runner: ModelRunner, device: DeviceSpec, measured_terms: MemoryTerms
) -> MemoryPlan:
    """The plan of `runner.config` on `device`, its KV cache sized from `measured_terms`; logs the plan
    made from the shapes beside it, term by term."""
    inputs = inputs_from_engine_config(runner.config, device)
    planned = plan_memory(inputs)
    measured = plan_memory(inputs, measured_terms)
    for line in planned_vs_measured(planned, measured):
        logger.info("Plan vs measured: %s", line)
    if measured.block_bytes != runner.kv_bytes_per_block():
        raise RuntimeError(
            f"the plan counts {measured.block_bytes} bytes per KV block, the engine allocates "
            f"{runner.kv_bytes_per_block()}: a fitserve bug, please report it"
        )
    return measured


def check_one_request_fits(plan: MemoryPlan, config: EngineConfig) -> None:
    """ValueError (as vLLM refuses it) when the KV cache cannot hold one request of max_model_len tokens,
    naming both numbers, the largest max_model_len that fits and the memory that would be needed."""
    max_model_len = config.model.max_model_len
    if config.cache.num_gpu_blocks_override is not None or plan.kv_cache_tokens >= max_model_len:
        return
    needed = max_model_len * plan.kv_bytes_per_token
    raise ValueError(
        f"the KV cache holds {plan.kv_cache_tokens:,} tokens, fewer than one request of max_model_len="
        f"{max_model_len:,} needs ({needed / GiB:.2f} GiB against {max(plan.free_for_kv_bytes, 0) / GiB:.2f} "
        f"GiB left for it): set --max-model-len {plan.kv_cache_tokens} or less, raise "
        f"--gpu-memory-utilization (now {config.cache.gpu_memory_utilization}), raise --cpu-offload-gb, or "
        "run `fitserve plan` with these flags for settings that fit"
    )


class CpuPlatform:
    def size_kv_cache(self, runner: ModelRunner) -> MemoryPlan:
        cache = runner.config.cache
        # Read now, with the weights loaded: what is left for the KV cache and the steps.
        # Tensor-parallel ranks share the host: every rank has loaded its part by now (the executor sizes
        # the cache after all of them report), so the RAM before any loaded is available + N x weights.
        ranks = runner.config.parallel.tensor_parallel_size
        available = available_ram_bytes()
        if cache.num_gpu_blocks_override is None:
            check_fits_in_ram(cache.cpu_kv_cache_space_gib, available, ranks)
        host = cpu_device(probe_host())
        weights = runner.weight_bytes + runner.draft_weight_bytes
        if available is not None:  # the RAM before the weights loaded: what the plan subtracts them from
            host = dataclasses.replace(host, free_bytes=available + ranks * weights)
        # the process itself is in neither figure: the plan's estimate of it stands
        terms = MemoryTerms(weights, 0, 0, CPU_RUNTIME_OVERHEAD_BYTES)
        plan = _sized_from_measurements(runner, host, terms)
        if plan.cpu_kv is not None:
            logger.info("%s", plan.cpu_kv.log_line())
        return plan

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
        # the custom all-reduce's symmetric memory, allocated when the tensor-parallel group formed, is this
        # engine's: left out of the baseline, it counts as non-torch memory within the budget
        custom = tp().custom_all_reduce
        self.baseline_used = total - free - (custom.device_bytes if custom is not None else 0)
        self.baseline_reserved = torch.cuda.memory_reserved()
        # Tensors this process already held (e.g. another engine not yet collected) are not ours either.
        self.baseline_allocated = torch.cuda.memory_allocated()

    def size_kv_cache(self, runner: ModelRunner) -> MemoryPlan:
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
        torch.cuda.empty_cache()
        self.weights_bytes = weights
        device = gpu_device_spec(torch.cuda.current_device())
        # The graphs need the KV cache's addresses, so they are captured after it is allocated: their
        # pools are reserved at the planner's estimate (an upper bound: on the 8B shape at the serving
        # budget 0.60 GiB against 0.53 taken); the log reports what capture really took.
        graph_reserve = cuda_graph_bytes(inputs_from_engine_config(config, device))
        plan = _sized_from_measurements(
            runner, device, MemoryTerms(weights, activation, graph_reserve, non_torch)
        )
        logger.info(
            "Memory profiling: total %.2f GiB x utilization %.2f = %.2f GiB; weights %.2f GiB, "
            "activation peak %.2f GiB, non-torch %.2f GiB, CUDA graph reserve %.2f GiB",
            total / GiB,
            config.cache.gpu_memory_utilization,
            plan.budget_bytes / GiB,
            weights / GiB,
            activation / GiB,
            non_torch / GiB,
            graph_reserve / GiB,
        )
        logger.info("Available KV cache memory: %.2f GiB", max(plan.free_for_kv_bytes, 0) / GiB)
        if config.cache.num_gpu_blocks_override is None and plan.num_kv_blocks < 2:
            raise ValueError(
                "no memory is left for the KV cache: "
                f"gpu_memory_utilization={config.cache.gpu_memory_utilization} gives "
                f"{plan.budget_bytes / GiB:.2f} GiB, of which weights take {weights / GiB:.2f} GiB and the "
                f"activation peak at max_num_batched_tokens={config.scheduler.max_num_batched_tokens} takes "
                f"{activation / GiB:.2f} GiB: raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens, or use a smaller model"
            )
        check_one_request_fits(plan, config)
        return plan

    def make_graph_runner(self, runner: ModelRunner) -> CudaGraphRunner | None:
        config = runner.config
        if config.compilation.enforce_eager:
            return None
        reason = getattr(runner.model, "cuda_graphs_unsupported", None)
        if reason:
            logger.info("CUDA graphs are off for this model (%s): decode steps run eagerly", reason)
            return None
        sizes = list(
            decode_capture_sizes(config.compilation.cudagraph_capture_sizes, config.scheduler.max_num_seqs)
        )
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
            layer_group=runner.layer_group,
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
            sizes=list(
                piecewise_capture_sizes(
                    config.scheduler.max_num_batched_tokens, torch.cuda.mem_get_info(runner.device)[1]
                )
            ),
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
