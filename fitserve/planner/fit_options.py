"""What would make a plan fit: each change the user could make, tried on the plan, kept when it fits.

"Fits" means the KV cache left over holds `needed_tokens` (one request of that length). Every option
is a real plan run with the changed setting, so the numbers it quotes are the planner's own. Options
fitserve runs come first (tensor parallel among them, on alike GPUs); those only vLLM runs today (some
quantization methods) follow, each saying so (engine_support.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitserve.planner.engine_support import (
    FP8_EXPERTS_MIN_CAPABILITY,
    INT4_EXPERT_MODEL_TYPES,
    MOE_QUANTIZATION,
    vllm_only,
)
from fitserve.planner.fit_parallel import size_problem
from fitserve.planner.formats import QUANTIZATION_METHODS
from fitserve.planner.hardware import GiB
from fitserve.planner.memory import MemoryPlan, plan_memory
from fitserve.planner.memory_estimates import decoder_layer_bytes_per_gpu
from fitserve.planner.memory_inputs import MemoryInputs, with_settings

# Raising gpu_memory_utilization is suggested up to this (leaving the rest for the CUDA context and
# fragmentation), and never above what is free.
MAX_SUGGESTED_UTILIZATION = 0.95
MAX_SUGGESTED_TENSOR_PARALLEL = 16
OFFLOAD_STEP_GIB = 0.5  # --cpu-offload-gb suggestions are rounded up to this
# Quantization choices offered, grouped when they store the same bits, with what each group needs.
_QUANT_GROUPS: dict[tuple[str, ...], str] = {
    ("fp8",): QUANTIZATION_METHODS["fp8"].how,
    ("awq", "gptq"): "4-bit, needs an AWQ or GPTQ checkpoint of the model",
    ("bitsandbytes",): QUANTIZATION_METHODS["bitsandbytes"].how,
}
# fitserve's engine runs these (awq / gptq from a checkpoint quantized that way), with --cpu-offload-gb too
RUN_BY_FITSERVE = {("awq", "gptq"), ("fp8",), ("bitsandbytes",)}


@dataclass(frozen=True)
class Headroom:
    """What the machine allows beyond the current settings."""

    max_utilization: float  # the highest gpu_memory_utilization the free memory allows
    num_gpus: int  # GPUs in the plan
    host_ram_available: int | None  # None when planning for assumed GPUs (the host is unknown)
    fewer_sequences: bool = False  # auto-fit may lower max_num_seqs (the user left it unset)


# auto-fit's steps of max_num_seqs when memory is short (planner/fit_knobs.py)
SHRINK_NUM_SEQS = (128, 64, 32, 16, 8)


def holds(inputs: MemoryInputs, needed_tokens: int) -> MemoryPlan | None:
    """The plan when its KV cache holds one request of `needed_tokens`, else None."""
    plan = plan_memory(inputs)
    return plan if _holds_request(plan, needed_tokens) else None


def _holds_request(plan: MemoryPlan, needed_tokens: int) -> bool:
    return plan.num_kv_blocks - 1 >= math.ceil(needed_tokens / plan.inputs.block_size)


def holds_as_fitted(inputs: MemoryInputs, needed_tokens: int, headroom: Headroom) -> MemoryPlan | None:
    """holds(), or, for a hybrid model whose max_num_seqs auto-fit may lower, the plan at the largest of
    auto-fit's steps of it that holds the request (the graph sizes capped to it): each sequence's state
    slot (tens of MiB) is what such a plan is short of, so an option that fits only with fewer sequences
    still fits as auto-fit would run it."""
    plan = plan_memory(inputs)
    if _holds_request(plan, needed_tokens):
        return plan
    if not headroom.fewer_sequences or not plan.recurrent_state_bytes:
        return None
    for seqs in (n for n in SHRINK_NUM_SEQS if n < inputs.max_num_seqs):
        sizes = tuple(size for size in inputs.cudagraph_capture_sizes if size <= seqs)
        plan = holds(with_settings(inputs, max_num_seqs=seqs, cudagraph_capture_sizes=sizes), needed_tokens)
        if plan is not None:
            return plan
    return None


def _fewer_sequences_note(inputs: MemoryInputs, plan: MemoryPlan) -> str:
    """ ", max_num_seqs lowered to N" when `plan` needed fewer sequences than `inputs` run."""
    seqs = plan.inputs.max_num_seqs
    return f", max_num_seqs lowered to {seqs}" if seqs < inputs.max_num_seqs else ""


def fitting_options(
    inputs: MemoryInputs, needed_tokens: int, headroom: Headroom, kv_options: bool = False
) -> list[str]:
    """One line per change that fits: those fitserve runs first, then those only vLLM runs (each
    saying so); the smallest sacrifice first within each kind."""
    options: list[str] = []
    if kv_options and inputs.kv_cache_dtype == "auto":
        plan = holds_as_fitted(with_settings(inputs, kv_cache_dtype="fp8"), needed_tokens, headroom)
        if plan is not None:
            options.append(
                f"--kv-cache-dtype fp8 (one byte per KV element): {plan.kv_cache_tokens:,} KV tokens"
                f"{_fewer_sequences_note(inputs, plan)}"
            )
    options += _utilization_options(inputs, needed_tokens, headroom)
    offload = _offload_option(inputs, needed_tokens, headroom)
    if offload:
        options.append(offload)
    quantization = _quantization_options(inputs, needed_tokens, headroom)
    moe = inputs.shape.is_moe
    runs = [text for group, text in quantization if _runs(inputs, group)]
    needs_vllm = [
        f"{text} ({MOE_QUANTIZATION})" if moe else vllm_only(text, "quantization")
        for group, text in quantization
        if not _runs(inputs, group)
    ]
    options += runs
    if not quantization and _can_quantize(inputs):
        for group in (("fp8",), ("awq", "gptq"), ("bitsandbytes",)):
            if not _runs(inputs, group):
                continue
            combined = _offload_option(with_settings(inputs, quantization=group[0]), needed_tokens, headroom)
            if combined:
                checkpoint = " (an AWQ or GPTQ checkpoint of the model)" if group == ("awq", "gptq") else ""
                options.append(f"--quantization {' or '.join(group)}{checkpoint} with {combined}")
    tensor_parallel = _tensor_parallel_option(inputs, needed_tokens, headroom)
    if tensor_parallel:
        options.append(tensor_parallel)
    return options + needs_vllm


def _utilization_options(inputs: MemoryInputs, needed_tokens: int, headroom: Headroom) -> list[str]:
    if not inputs.on_gpu:
        return []
    ceiling = min(MAX_SUGGESTED_UTILIZATION, headroom.max_utilization)
    first = math.floor(round(inputs.gpu_memory_utilization * 100, 6)) + 1
    for percent in range(first, math.floor(round(ceiling * 100, 6)) + 1):
        candidate = with_settings(inputs, gpu_memory_utilization=percent / 100)
        plan = holds_as_fitted(candidate, needed_tokens, headroom)
        if plan is not None:
            return [
                f"--gpu-memory-utilization {percent / 100:.2f} ({plan.budget_bytes / GiB:.2f} GiB of "
                f"the GPU): {plan.kv_cache_tokens:,} KV tokens{_fewer_sequences_note(inputs, plan)}"
            ]
    return []


def _runs(inputs: MemoryInputs, group: tuple[str, ...]) -> bool:
    """Whether fitserve's engine runs the model quantized by `group`: a MoE's experts would be quantized
    too, which the model types in INT4_EXPERT_MODEL_TYPES run from int4 checkpoints and as fp8 (on GPUs of
    compute capability FP8_EXPERTS_MIN_CAPABILITY and up)."""
    if group not in RUN_BY_FITSERVE:
        return False
    if not inputs.shape.is_moe:
        return True
    if inputs.shape.model_type not in INT4_EXPERT_MODEL_TYPES:
        return False
    capability = inputs.device.capability
    fp8_runs = capability is None or capability >= FP8_EXPERTS_MIN_CAPABILITY
    return group == ("awq", "gptq") or (group == ("fp8",) and fp8_runs)


def _can_quantize(inputs: MemoryInputs) -> bool:
    return inputs.quantization is None and inputs.weights.checkpoint_quantization is None


def _quantization_options(
    inputs: MemoryInputs, needed_tokens: int, headroom: Headroom
) -> list[tuple[tuple[str, ...], str]]:
    """(methods, suggestion) for each group of quantization methods that makes the plan fit."""
    if not _can_quantize(inputs):
        return []
    options = []
    capability = inputs.device.capability
    for group, how in _QUANT_GROUPS.items():
        method = QUANTIZATION_METHODS[group[0]]
        if capability is not None and capability < method.min_capability:
            continue
        plan = holds_as_fitted(with_settings(inputs, quantization=group[0]), needed_tokens, headroom)
        if plan is None:
            continue
        options.append(
            (
                group,
                f"--quantization {' or '.join(group)} ({how}): weights {plan.weights_gib_per_gpu:.2f} GiB "
                f"per GPU, {plan.kv_cache_tokens:,} KV tokens{_fewer_sequences_note(inputs, plan)}",
            )
        )
    return options


def _offload_option(inputs: MemoryInputs, needed_tokens: int, headroom: Headroom) -> str | None:
    """The smallest --cpu-offload-gb (in OFFLOAD_STEP_GIB steps) that fits, if offloading can fit at all."""
    if not inputs.on_gpu:
        return None
    plan = plan_memory(inputs)
    kv_needed = math.ceil(needed_tokens / inputs.block_size + 1) * plan.block_bytes
    short = plan.terms.total + kv_needed - plan.budget_bytes
    if short <= 0:
        return None
    offloadable = decoder_layer_bytes_per_gpu(inputs) * inputs.shape.num_layers
    offload_gib = inputs.cpu_offload_gb + math.ceil(short / GiB / OFFLOAD_STEP_GIB) * OFFLOAD_STEP_GIB
    # never start past the decoder layers' bytes: a guess that rounds up beyond them may still fit below
    largest = math.floor(offloadable / GiB / OFFLOAD_STEP_GIB) * OFFLOAD_STEP_GIB
    offload_gib = max(inputs.cpu_offload_gb, min(offload_gib, largest))
    fitted = None
    # The first guess frees `short` but ignores the staging buffer of one layer the GPU then holds.
    while fitted is None and offload_gib * GiB <= offloadable:
        fitted = holds_as_fitted(with_settings(inputs, cpu_offload_gb=offload_gib), needed_tokens, headroom)
        if fitted is None:
            offload_gib += OFFLOAD_STEP_GIB
    if fitted is None:
        return None  # even with every decoder layer in CPU memory the rest does not fit
    # It may also overshoot: offloading drops the terms that need the whole layer on the GPU (the
    # pieces' CUDA graphs of steps with prompt tokens), so step back while a smaller amount still fits.
    while offload_gib - OFFLOAD_STEP_GIB > inputs.cpu_offload_gb:
        less = with_settings(inputs, cpu_offload_gb=offload_gib - OFFLOAD_STEP_GIB)
        smaller = holds_as_fitted(less, needed_tokens, headroom)
        if smaller is None:
            break
        offload_gib, fitted = offload_gib - OFFLOAD_STEP_GIB, smaller
    host_needed = offload_gib * GiB * inputs.tensor_parallel_size
    ram = ""
    if headroom.host_ram_available is not None and host_needed > headroom.host_ram_available:
        ram = f"; this host has only {headroom.host_ram_available / GiB:.1f} GiB of RAM available"
    return (
        f"--cpu-offload-gb {offload_gib:g} ({offload_gib:g} GiB of each GPU's weights stay in CPU memory and "
        f"cross PCIe every step, which is slow; {host_needed / GiB:g} GiB of host RAM{ram}): weights "
        f"{fitted.weights_gib_per_gpu:.2f} GiB per GPU, {fitted.kv_cache_tokens:,} KV tokens"
        f"{_fewer_sequences_note(inputs, fitted)}"
    )


def _tensor_parallel_option(inputs: MemoryInputs, needed_tokens: int, headroom: Headroom) -> str | None:
    """The smallest larger tensor-parallel size that fits; without CPU offload when it fits without."""
    if not inputs.on_gpu:
        return None
    for size in range(inputs.tensor_parallel_size + 1, MAX_SUGGESTED_TENSOR_PARALLEL + 1):
        if size_problem(inputs.shape, size) is not None:
            continue
        for offload in sorted({0.0, inputs.cpu_offload_gb}):
            candidate = with_settings(inputs, tensor_parallel_size=size, cpu_offload_gb=offload)
            plan = holds_as_fitted(candidate, needed_tokens, headroom)
            if plan is None:
                continue
            have = "" if headroom.num_gpus >= size else f"; this plan has {headroom.num_gpus}"
            drop = ""
            if inputs.cpu_offload_gb:
                drop = " and no --cpu-offload-gb" if not offload else f" keeping --cpu-offload-gb {offload:g}"
            return (
                f"--tensor-parallel-size {size}{drop} ({size} GPUs like this one{have}): weights "
                f"{plan.weights_gib_per_gpu:.2f} GiB per GPU, {plan.kv_cache_tokens:,} KV tokens"
                f"{_fewer_sequences_note(inputs, plan)}"
            )
    return None
