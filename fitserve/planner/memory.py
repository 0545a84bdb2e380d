"""The memory plan: a pure function from (model shape, weights, dtypes, device, limits) to bytes per GPU.

On a GPU, as in vLLM, `gpu_memory_utilization` is the fraction of the GPU's total memory this engine may
use. Out of that budget come the weights, the activation peak of one step at max_num_batched_tokens,
the CUDA graph pool and the runtime's own memory; what remains becomes KV cache blocks. On the CPU the
budget is the RAM available and the KV cache is the engine's own rule (fitserve/cpu_kv_cache.py):
--cpu-kv-cache-space, else 2 requests of max_model_len within half the RAM the weights leave; the
weights count the int4 and float16 forms the CPU engine keeps (planner/weights.py, CpuKeptForms).
With tensor_parallel_size N every number is one rank's (one GPU's; on the CPU one of N processes, whose
budget is 1/N of the RAM available and whose KV cache is sized from 1/N of what all N ranks' weights
leave). With pipeline_parallel_size P each stage holds its range of decoder layers (distributed/pipeline.py),
the first the embedding, the last the final norm and LM head: every stage keeps the same KV blocks, so
the pool is the fewest blocks any stage's rank has room for, and the plan's numbers are that stage's.

Every term is an estimate from the shapes (docs/memory.md derives each one). The engine calls
`plan_memory` again at startup with what it measured (`MemoryTerms`), which sizes the KV cache from
the measured numbers, and logs `planned_vs_measured` of the two plans.

This file holds the plan (`MemoryTerms`, `MemoryPlan`, `plan_memory`, a pipeline stage's re-sizing)
and that comparison. What the plan is computed from is planner/memory_inputs.py; the estimate of each
non-KV term planner/memory_estimates.py; KV and recurrent-state bytes planner/kv_memory.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fitserve.cpu_kv_cache import CpuKvCacheSize
from fitserve.distributed.pipeline import describe_split, stage_layer_ranges
from fitserve.kv_groups import group_num_blocks
from fitserve.offload_split import NO_OFFLOAD, OffloadSplit
from fitserve.planner.formats import DTYPE_BYTES
from fitserve.planner.hardware import GiB
from fitserve.planner.kv_memory import (
    cpu_kv_size,
    kv_bytes_per_token,
    kv_groups,
    recurrent_state_bytes,
    stage_kv_bytes_per_token,
    state_snapshot_bytes,
)
from fitserve.planner.memory_estimates import (
    activation_peak_bytes,
    cuda_graph_bytes,
    offload_split,
    runtime_overhead_bytes,
    stage_weight_bytes,
    weight_bytes_per_gpu,
)
from fitserve.planner.memory_inputs import MemoryInputs


@dataclass(frozen=True)
class MemoryTerms:
    """The non-KV memory of one GPU (bytes): what the planner estimates, or what the engine measured."""

    weights: int
    activation: int
    cuda_graphs: int
    runtime_overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.activation + self.cuda_graphs + self.runtime_overhead


@dataclass(frozen=True)
class MemoryPlan:
    inputs: MemoryInputs
    terms: MemoryTerms  # the terms the KV cache was sized from
    estimated: MemoryTerms  # the planner's estimates (== terms unless measured ones were given)
    weights_bytes_per_gpu_before_offload: int
    weights_offloaded_bytes: int  # per GPU, kept in CPU memory
    budget_bytes: int  # per GPU: total x gpu_memory_utilization (CPU: the rank's share of the RAM available)
    kv_bytes_per_token: int  # per GPU
    num_kv_blocks: int  # allocated, the null block included
    kv_cache_bytes: int  # per GPU
    free_for_kv_bytes: int  # per GPU: budget minus the terms; negative when they do not fit
    notes: tuple[str, ...] = field(default=())
    offload: OffloadSplit = NO_OFFLOAD  # --cpu-offload-gb: the decoder layers kept in CPU memory
    cpu_kv: CpuKvCacheSize | None = None  # on the CPU: the KV cache's size and why (the engine's rule)
    # per GPU: hybrid models' recurrent state pool (max_num_seqs + 1 live slots and the prefix cache's
    # snapshot slots), before the KV cache
    recurrent_state_bytes: int = 0
    state_snapshot_bytes: int = 0  # the snapshot slots' part of recurrent_state_bytes
    pipeline_stage: int = 0  # with pipeline stages: the stage one of whose ranks these numbers are

    @property
    def num_layers_held(self) -> int:
        """The decoder layers this plan's rank holds: its pipeline stage's (all of them without stages)."""
        shape, stages = self.inputs.shape, self.inputs.pipeline_parallel_size
        if stages == 1:
            return shape.num_layers
        start, end = stage_layer_ranges(shape.num_layers, stages)[self.pipeline_stage]
        return end - start

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.inputs.block_size

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens requests can use: every block but the reserved null block (the engine's count)."""
        return max(0, self.num_kv_blocks - 1) * self.inputs.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests the KV cache holds at once."""
        blocks_per_request = math.ceil(self.inputs.max_model_len / self.inputs.block_size)
        return max(0, self.num_kv_blocks - 1) / blocks_per_request

    @property
    def group_num_blocks(self) -> tuple[int, ...]:
        """Each KV cache group's pool (null block included), in kv_groups order; (num_kv_blocks,) for one."""
        groups = kv_groups(self.inputs)
        if len(groups) <= 1:
            return (self.num_kv_blocks,)
        full_need = math.ceil(self.inputs.max_model_len / self.inputs.block_size)
        return group_num_blocks(groups, self.num_kv_blocks, full_need)

    @property
    def weights_gib_per_gpu(self) -> float:
        return self.terms.weights / GiB

    @property
    def activation_gib(self) -> float:
        return self.terms.activation / GiB

    @property
    def cuda_graph_gib(self) -> float:
        return self.terms.cuda_graphs / GiB

    @property
    def runtime_overhead_gib(self) -> float:
        return self.terms.runtime_overhead / GiB

    @property
    def kv_cache_gib_per_gpu(self) -> float:
        return self.kv_cache_bytes / GiB


def plan_memory(inputs: MemoryInputs, measured: MemoryTerms | None = None) -> MemoryPlan:
    """The plan for `inputs`; with `measured`, the KV cache is sized from the measured terms instead.
    With pipeline stages, the plan of the stage whose ranks hold the fewest KV blocks (every stage
    keeps the same blocks), with a note naming the split."""
    _check_inputs(inputs)
    stages = inputs.pipeline_parallel_size
    if stages == 1:
        return _plan(inputs, measured, weight_bytes_per_gpu(inputs), kv_bytes_per_token(inputs))
    plans = [
        _plan(inputs, measured, stage_weight_bytes(inputs, stage), stage_kv_bytes_per_token(inputs, stage))
        for stage in range(stages)
    ]
    fullest = min(range(stages), key=lambda stage: (plans[stage].num_kv_blocks, -stage))
    split = describe_split(inputs.shape.num_layers, stages)
    note = (
        f"pipeline parallel: {split}; every number is one rank of stage {fullest}, the one with room for "
        "the fewest KV blocks (every stage keeps the same blocks). Stages run one after another on one "
        "batch at a time"
    )
    return replace(plans[fullest], notes=(*plans[fullest].notes, note), pipeline_stage=fullest)


def _plan(inputs: MemoryInputs, measured: MemoryTerms | None, on_disk: int, per_token: int) -> MemoryPlan:
    """The plan of one rank holding `on_disk` bytes of weights and `per_token` KV bytes per token."""
    offload, offload_note = offload_split(inputs)
    draft_weights = inputs.draft.weight_bytes if inputs.draft is not None else 0
    estimated = MemoryTerms(
        weights=on_disk - offload.gpu_bytes_saved + draft_weights,
        activation=activation_peak_bytes(inputs),
        cuda_graphs=cuda_graph_bytes(inputs),
        runtime_overhead=runtime_overhead_bytes(inputs),
    )
    terms = measured or estimated
    block_bytes = per_token * inputs.block_size
    state = recurrent_state_bytes(inputs)
    if inputs.on_gpu:
        budget = int(inputs.device.total_bytes * inputs.gpu_memory_utilization)
        free_for_kv = budget - terms.total - state
        cpu_kv = None
    else:
        # Ranks are processes sharing the host's RAM: each plans for its share of it.
        ranks = inputs.world_size
        budget = inputs.device.free_bytes // ranks
        # the RAM available once every rank's weights are loaded: what the engine reads when it sizes the
        # cache (cpu_kv_size splits it between the ranks)
        cpu_kv = None
        if inputs.num_gpu_blocks_override is None:
            left = inputs.device.free_bytes - ranks * (terms.weights + state)
            cpu_kv = cpu_kv_size(inputs, max(0, left), per_token)
        free_for_kv = cpu_kv.bytes if cpu_kv is not None else 0
    if inputs.num_gpu_blocks_override is not None:
        num_blocks = inputs.num_gpu_blocks_override
    else:
        num_blocks = max(0, free_for_kv // block_bytes)
    notes = [offload_note] if offload_note else []
    return MemoryPlan(
        inputs=inputs,
        terms=terms,
        estimated=estimated,
        weights_bytes_per_gpu_before_offload=on_disk,
        weights_offloaded_bytes=offload.offloaded_bytes,
        budget_bytes=budget,
        kv_bytes_per_token=per_token,
        num_kv_blocks=num_blocks,
        kv_cache_bytes=num_blocks * block_bytes,
        free_for_kv_bytes=free_for_kv,
        notes=tuple(notes),
        offload=offload,
        cpu_kv=cpu_kv,
        recurrent_state_bytes=state,
        state_snapshot_bytes=state_snapshot_bytes(inputs),
    )


def for_pipeline_stage(plan: MemoryPlan, per_token: int) -> MemoryPlan:
    """A plan sized over every layer, re-sized for a pipeline stage's rank that keeps `per_token` KV bytes
    per token (its layers'): on a GPU the memory left for the cache holds more blocks; on the CPU the
    pool keeps its tokens (the engine's rule counts requests), in fewer bytes. A fixed pool
    (num_gpu_blocks_override) keeps its blocks."""
    inputs = plan.inputs
    blocks = plan.num_kv_blocks
    if inputs.on_gpu and inputs.num_gpu_blocks_override is None:
        blocks = max(0, plan.free_for_kv_bytes // (per_token * inputs.block_size))
    return replace(
        plan,
        kv_bytes_per_token=per_token,
        num_kv_blocks=blocks,
        kv_cache_bytes=blocks * per_token * inputs.block_size,
    )


def planned_vs_measured(planned: MemoryPlan, measured: MemoryPlan) -> list[str]:
    """Log lines comparing the plan made before loading with the one sized from measurements."""
    rows = [
        ("weights", planned.terms.weights, measured.terms.weights),
        ("activation peak", planned.terms.activation, measured.terms.activation),
        ("CUDA graphs", planned.terms.cuda_graphs, measured.terms.cuda_graphs),
        ("runtime overhead", planned.terms.runtime_overhead, measured.terms.runtime_overhead),
        ("KV cache", planned.kv_cache_bytes, measured.kv_cache_bytes),
    ]
    lines = [
        f"{name}: planned {p / GiB:.2f} GiB, measured {m / GiB:.2f} GiB ({_relative(p, m)})"
        for name, p, m in rows
    ]
    lines.append(
        f"KV cache tokens: planned {planned.kv_cache_tokens:,}, measured {measured.kv_cache_tokens:,} "
        f"({_relative(planned.kv_cache_tokens, measured.kv_cache_tokens)})"
    )
    return lines


def _relative(planned: float, measured: float) -> str:
    if measured == 0:
        return "exact" if planned == 0 else "n/a"
    return f"{(planned - measured) / measured * 100:+.1f}%"


def _check_inputs(inputs: MemoryInputs) -> None:
    if inputs.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={inputs.dtype!r} is not one of {', '.join(DTYPE_BYTES)}: resolve it first")
    positive = {
        "max_model_len": inputs.max_model_len,
        "max_num_batched_tokens": inputs.max_num_batched_tokens,
        "max_num_seqs": inputs.max_num_seqs,
        "block_size": inputs.block_size,
        "tensor_parallel_size": inputs.tensor_parallel_size,
        "pipeline_parallel_size": inputs.pipeline_parallel_size,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(
                f"{name}={value} is below the minimum 1: set --{name.replace('_', '-')} to 1 or more"
            )
