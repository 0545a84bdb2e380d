"""The refusals made before loading a byte, each naming the numbers and what would fit."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from fitserve.args import EngineArgs
from fitserve.args_support import CHECKPOINT_QUANTIZATIONS
from fitserve.config import FP8_KV_CACHE_DTYPES
from fitserve.planner.engine_support import FP8_EXPERTS_MIN_CAPABILITY, MOE_QUANTIZATION, NOT_RUN_BY_FITSERVE
from fitserve.planner.fit_options import Headroom, fitting_options
from fitserve.planner.fit_parallel import mismatch_refusal, pipeline_refusal, size_refusal, working_sizes
from fitserve.planner.formats import format_capability, quant_method
from fitserve.planner.hardware import DeviceSpec, GiB
from fitserve.planner.memory import MemoryPlan, plan_memory
from fitserve.planner.memory_inputs import MemoryInputs, with_settings
from fitserve.planner.model_info import ModelInfo
from fitserve.planner.model_shape import ModelShape

# The Triton paged-attention kernels tile a block's tokens: a power of two of at least 16.
MIN_CUDA_BLOCK_SIZE = 16
# A float8 KV cache is written and read by the Triton kernels, which run from Volta on: e5m2 through
# Triton's conversion, e4m3 through it from 8.9 and from its bytes below (kernels/fp8_bits.py).
FP8_KV_CACHE_MIN_CAPABILITY = (7, 0)
# A smaller --cpu-kv-cache-space is suggested down to this many GiB, holding at least one request of
# this many tokens (or of max_model_len when that is shorter).
MIN_SUGGESTED_KV_GIB = 0.1
MIN_SUGGESTED_KV_TOKENS = 1024


class PlanError(ValueError):
    """The model cannot run as asked. `kind` names the check: weights, kv_cache,
    gpu_memory_utilization, devices, dtype, quantization, kv_cache_dtype, max_model_len, host_memory."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def check_devices(args: EngineArgs, devices: Sequence[DeviceSpec], shape: ModelShape) -> list[DeviceSpec]:
    """The devices the plan uses: the first tensor_parallel_size x pipeline_parallel_size GPUs, or the
    CPU (whose ranks are processes sharing its RAM). Refuses a size that cannot split the model, more
    stages than it has layers (or a family that does not run in stages), more ranks than GPUs, and GPUs
    that differ; assumed GPUs (`fitserve plan --assume-gpus`) are named by that flag in the fix."""
    tp = args.tensor_parallel_size
    stages = args.pipeline_parallel_size
    refusal = pipeline_refusal(shape.model_type, shape.num_layers, stages)
    if refusal is not None:
        raise PlanError("devices", refusal)
    if not devices:
        raise PlanError("devices", "no device to plan for: give --assume-gpus COUNTxGiB, e.g. 1x24")
    refusal = size_refusal(shape, tp)
    if refusal is not None:
        raise PlanError("devices", refusal)
    if devices[0].kind == "cpu":
        return [devices[0]]
    if args.distributed_executor_backend == "ray" and not devices[0].assumed:
        # Ray places the ranks on the cluster's GPUs, counted when the engine starts (worker/ray_ranks.py):
        # the ranks this machine lacks are planned like its first GPU
        devices = [*devices, *[devices[0]] * (tp * stages - len(devices))]
    if stages > 1:
        return _pipeline_devices(tp, stages, devices, shape)
    if tp > len(devices):
        fewer = working_sizes(shape, len(devices))[-1]
        if devices[0].assumed:
            raise PlanError(
                "devices",
                f"tensor_parallel_size={tp} needs {tp} GPUs, the plan has {len(devices)}: set "
                f"--tensor-parallel-size {fewer}{' or less' if fewer > 1 else ''}, or plan for more with "
                f"--assume-gpus {tp}x{devices[0].total_gib:g}",
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        listed = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise PlanError(
            "devices",
            f"tensor_parallel_size={tp} needs {tp} GPUs, torch sees {len(devices)}{listed}: set "
            f"--tensor-parallel-size {fewer}{' or less' if fewer > 1 else ''}, or make {tp} GPUs visible "
            "(CUDA_VISIBLE_DEVICES lists them)",
        )
    mismatch = mismatch_refusal(tp, devices, shape)
    if mismatch is not None:
        raise PlanError("devices", mismatch)
    return list(devices[:tp])


def _pipeline_devices(
    tp: int, stages: int, devices: Sequence[DeviceSpec], shape: ModelShape
) -> list[DeviceSpec]:
    """The first tp x stages GPUs, alike; refused when there are fewer, naming the sizes that fit."""
    world = tp * stages
    if world > len(devices):
        fewer = max(1, len(devices) // tp)
        seen = f"the plan has {len(devices)}" if devices[0].assumed else f"torch sees {len(devices)}"
        head = f"tensor_parallel_size={tp} x pipeline_parallel_size={stages} needs {world} GPUs, {seen}"
        if devices[0].assumed:
            more = f"plan for more with --assume-gpus {world}x{devices[0].total_gib:g}"
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            head += f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
            more = f"make {world} GPUs visible (CUDA_VISIBLE_DEVICES lists them)"
        or_less = " or less" if fewer > 1 else ""
        raise PlanError("devices", f"{head}: set --pipeline-parallel-size {fewer}{or_less}, or {more}")
    mismatch = mismatch_refusal(world, devices, shape, stages)
    if mismatch is not None:
        raise PlanError("devices", mismatch)
    return list(devices[:world])


def check_block_size(block_size: int, used: Sequence[DeviceSpec]) -> None:
    if used[0].kind == "cuda" and block_size < MIN_CUDA_BLOCK_SIZE:
        raise PlanError(
            "block_size",
            f"block_size={block_size} is below {MIN_CUDA_BLOCK_SIZE}, the smallest block the CUDA "
            f"attention kernels take: set --block-size {MIN_CUDA_BLOCK_SIZE} (or 32, 64, 128)",
        )


def check_fp8_kv_cache_on_gpu(kv_cache_dtype: str, capability: tuple[int, int]) -> None:
    """A float8 cache (e4m3 or e5m2) runs wherever fitserve's Triton kernels do: compute capability 7.0
    (Volta) and newer; below 8.9 the kernels convert e4m3 from its bits (kernels/fp8_bits.py)."""
    dtype = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    if dtype is not None and capability < FP8_KV_CACHE_MIN_CAPABILITY:
        kind = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype} (float8 {kind}) is written and read by fitserve's Triton "
            f"kernels, which need compute capability {format_capability(FP8_KV_CACHE_MIN_CAPABILITY)}; "
            f"this GPU has {format_capability(capability)}: run on a GPU of compute capability 7.0 or newer, "
            "or on the CPU (--device cpu)"
        )


def check_quantization(quantization: str | None, model: ModelInfo, used: Sequence[DeviceSpec]) -> None:
    checkpoint = model.weights.checkpoint_quantization
    if quantization is None:
        return
    try:
        method = quant_method(quantization)
    except ValueError as error:
        raise PlanError("quantization", str(error)) from None
    if checkpoint is not None and quant_method_or_none(checkpoint) not in (None, method):
        raise PlanError(
            "quantization",
            f"quantization={quantization!r} but the checkpoint is already quantized with {checkpoint}: "
            f"drop --quantization or set it to {checkpoint}",
        )
    capabilities = [d.capability for d in used if d.capability is not None]
    if capabilities and min(capabilities) < method.min_capability:
        raise PlanError(
            "quantization",
            f"quantization={quantization!r} needs compute capability "
            f"{format_capability(method.min_capability)}, "
            f"the GPU has {format_capability(min(capabilities))}: "
            + "use a 4-bit AWQ or GPTQ checkpoint of the model instead (fitserve runs those)",
        )


def check_fp8_experts(model: ModelInfo, used: Sequence[DeviceSpec], quantization: str | None = None) -> None:
    """PlanError for fp8 MoE experts (layers/moe_fp8.py: an FP8 checkpoint's, or --quantization fp8's) on
    a GPU below compute capability 7.5, without the 16-bit tensor-core products their kernels use: before
    anything loads."""
    from fitserve.layers.quantization.quant_config import quant_format
    from fitserve.models.moe_experts_format import GEMMA_EXPERTS, QWEN_EXPERTS, fp8_experts

    if not model.shape.num_experts:
        return
    try:
        fmt = quant_format(model.hf_config, quantization)  # the checkpoint's format, or the flag's
    except ValueError:  # refused with its own message where the format is checked
        return
    layers = range(model.shape.num_layers)
    blocks = (QWEN_EXPERTS, GEMMA_EXPERTS)  # where Qwen's and Gemma-4's checkpoints keep a layer's experts
    if not any(fp8_experts(model.hf_config, fmt, i, block) for i in layers for block in blocks):
        return
    old = [d for d in used if d.capability is not None and d.capability < FP8_EXPERTS_MIN_CAPABILITY]
    if old:
        raise PlanError(
            "quantization",
            f"{old[0].label()}: fp8 MoE experts (an FP8 checkpoint's or --quantization fp8's) run on GPUs "
            f"of compute capability {format_capability(FP8_EXPERTS_MIN_CAPABILITY)} and up (Turing and "
            f"later), this one has {format_capability(old[0].capability)}: use the model's int4 (AWQ / GPTQ) "
            "or 16-bit checkpoint without --quantization (`fitserve plan` says how each fits)",
        )


def quant_method_or_none(name: str) -> object | None:
    try:
        return quant_method(name)
    except ValueError:
        return None


def utilization_error(asked: float, device: DeviceSpec, fits: float) -> PlanError:
    held = device.total_gib - device.free_gib
    fix = (
        f"set --gpu-memory-utilization {fits:.2f} or lower, or stop the other processes"
        if fits >= 0.05
        else "stop the other processes on it, or use another GPU"
    )
    return PlanError(
        "gpu_memory_utilization",
        f"gpu_memory_utilization={asked:g} asks for {asked * device.total_gib:.2f} GiB of "
        f"{device.label()} but only "
        f"{device.free_gib:.2f} GiB is free (other processes hold {held:.2f} GiB): {fix}",
    )


def _budget_lines(plan: MemoryPlan, kv_line: str, adjusted: Sequence[str]) -> str:
    inputs, terms = plan.inputs, plan.terms
    if inputs.on_gpu:
        budget = (
            f"gpu_memory_utilization {inputs.gpu_memory_utilization:g} x {inputs.device.total_gib:.2f} GiB = "
            f"{plan.budget_bytes / GiB:.2f} GiB"
        )
    else:
        budget = f"{plan.budget_bytes / GiB:.2f} GiB of RAM available"
    lines = [
        f"  budget: {budget}",
        f"  weights: {terms.weights / GiB:.2f} GiB",
        f"  activation peak: {terms.activation / GiB:.2f} GiB (max_num_batched_tokens "
        f"{inputs.max_num_batched_tokens}, max_num_seqs {inputs.max_num_seqs})",
        f"  CUDA graphs: {terms.cuda_graphs / GiB:.2f} GiB ({len(inputs.cudagraph_capture_sizes)} sizes)",
        f"  runtime overhead: {terms.runtime_overhead / GiB:.2f} GiB",
        f"  {kv_line}",
    ]
    if adjusted:
        lines.append(f"  (auto-fit already lowered the unset {', '.join(adjusted)})")
    return "\n".join(lines)


def _options_text(options: list[str], plan: MemoryPlan, needed: int) -> str:
    if options:
        return "What would fit (any one line):\n" + "\n".join(f"  {option}" for option in options)
    inputs = plan.inputs
    kv_needed = (math.ceil(needed / inputs.block_size) + 1) * plan.block_bytes
    total_needed = (plan.terms.total + kv_needed) / GiB
    gpu = inputs.gpu_memory_utilization if inputs.on_gpu else 1.0
    return (
        f"No single change planned here fits: it takes about {total_needed:.1f} GiB per device "
        f"(a GPU of {total_needed / gpu:.0f} GiB at gpu_memory_utilization {gpu:g}), or a smaller model"
    )


def weights_error(plan: MemoryPlan, needed: int, headroom: Headroom) -> PlanError:
    inputs = plan.inputs
    kv_needed = (math.ceil(needed / inputs.block_size) + 1) * plan.block_bytes
    short = (plan.terms.total + kv_needed - plan.budget_bytes) / GiB
    quant = f", quantization {inputs.quantization}" if inputs.quantization else ""
    offload = f", {inputs.cpu_offload_gb:g} GiB offloaded" if inputs.cpu_offload_gb else ""
    head = (
        f"the weights do not fit on {inputs.device.label()}: {plan.terms.weights / GiB:.2f} GiB per GPU "
        f"({inputs.weights.total_params / 1e9:.2f} B parameters, {inputs.dtype}{quant}{offload}, "
        f"tensor_parallel_size {inputs.tensor_parallel_size}) leave no room for a {needed:,}-token request: "
        f"{short:.2f} GiB short"
    )
    kv_line = f"KV cache for one {needed:,}-token request: {kv_needed / GiB:.2f} GiB"
    options = fitting_options(inputs, needed, headroom)
    return PlanError(
        "weights", f"{head}\n{_budget_lines(plan, kv_line, ())}\n{_options_text(options, plan, needed)}"
    )


def kv_cache_error(
    plan: MemoryPlan, needed: int, headroom: Headroom, adjusted: Sequence[str] = ()
) -> PlanError:
    inputs = plan.inputs
    if not inputs.on_gpu and plan.terms.total >= plan.budget_bytes:
        return host_memory_error(plan)  # RAM, not the KV cache, is short: GPU-only fixes do not apply
    usable = max(0, plan.num_kv_blocks - 1) * inputs.block_size
    head = (
        f"the KV cache cannot hold one max_model_len={needed:,} request: what is left after the "
        "weights holds "
        f"{usable:,} tokens"
    )
    kv_line = (
        f"KV cache: {plan.kv_cache_bytes / GiB:.2f} GiB = {usable:,} tokens at "
        f"{plan.kv_bytes_per_token / 1024:g} KiB per token"
    )
    options = []
    if usable >= inputs.block_size:
        options.append(f"--max-model-len {usable} (the largest that fits)")
    options += fitting_options(inputs, needed, headroom, kv_options=True)
    return PlanError(
        "kv_cache",
        f"{head}\n{_budget_lines(plan, kv_line, adjusted)}\n{_options_text(options, plan, needed)}",
    )


def check_host_memory(plan: MemoryPlan, host_ram_available: int | None) -> None:
    inputs = plan.inputs
    if inputs.on_gpu:
        offloaded = plan.weights_offloaded_bytes * inputs.tensor_parallel_size
        if host_ram_available is not None and offloaded > host_ram_available:
            raise PlanError(
                "host_memory",
                f"cpu_offload_gb={inputs.cpu_offload_gb:g} per GPU keeps {offloaded / GiB:.2f} GiB of "
                "weights in "
                f"host RAM but {host_ram_available / GiB:.2f} GiB is available: lower "
                "--cpu-offload-gb, or add --quantization fp8 or bitsandbytes (or use an int4 checkpoint) to "
                "shrink the weights",
            )
        return
    if _ram_needed(plan) > plan.budget_bytes:
        raise host_memory_error(plan)


def host_memory_error(plan: MemoryPlan) -> PlanError:
    """A CPU plan over the RAM available, with each change that would fit it."""
    needed = _ram_needed(plan)
    fixes = _ram_fixes(plan)
    if fixes:
        fix = "any one of: " + "; ".join(fixes)
    else:
        fix = (
            f"no setting fits it, the weights alone take {plan.terms.weights / GiB:.2f} GiB: use a "
            "smaller model, a 4-bit GGUF of it, or a machine with more RAM"
        )
    ranks = plan.inputs.tensor_parallel_size
    who, available = "the model needs", f"{plan.budget_bytes / GiB:.2f} GiB is available"
    if ranks > 1:  # CPU ranks: each plans in its share of the RAM
        who = f"each of the {ranks} CPU ranks needs"
        available = (
            f"its share of the RAM available is {plan.budget_bytes / GiB:.2f} GiB "
            f"({plan.inputs.device.free_gib:.2f} GiB / {ranks})"
        )
        fix += "; or a smaller --tensor-parallel-size (each rank has its own activations and runtime)"
    return PlanError(
        "host_memory",
        f"{who} {needed / GiB:.2f} GiB of RAM (weights {plan.terms.weights / GiB:.2f}, "
        "KV cache "
        f"{plan.kv_cache_bytes / GiB:.2f}, activations and runtime "
        f"{(plan.terms.activation + plan.terms.runtime_overhead) / GiB:.2f}) but {available}: {fix}",
    )


def _ram_needed(plan: MemoryPlan) -> int:
    return plan.terms.total + plan.kv_cache_bytes


def _ram_fixes(plan: MemoryPlan) -> list[str]:
    """Each change that fits a CPU plan in RAM, tried on the plan: a smaller KV cache, smaller steps,
    bfloat16 weights (with a smaller KV cache if need be). None repeats a value already in the plan."""
    inputs = plan.inputs
    fixes = []
    kv_gib = _kv_room_gib(plan)
    if kv_gib is not None and kv_gib < plan.kv_cache_bytes / GiB:
        fixes.append(f"--cpu-kv-cache-space {kv_gib:g} ({_kv_tokens(inputs, kv_gib):,} KV tokens)")
    batched = inputs.max_num_batched_tokens // 2
    while batched >= max(inputs.max_num_seqs, 1):
        step = plan_memory(with_settings(inputs, max_num_batched_tokens=batched))
        if _ram_needed(step) <= step.budget_bytes:
            activation = step.terms.activation / GiB
            fixes.append(f"--max-num-batched-tokens {batched} (activation peak {activation:.2f} GiB)")
            break
        batched //= 2
    if inputs.dtype == "float32":
        half = plan_memory(with_settings(inputs, dtype="bfloat16"))
        weights = f"weights {half.terms.weights / GiB:.2f} GiB; bfloat16 matmuls are slower on most CPUs"
        half_kv_gib = _kv_room_gib(half)
        if _ram_needed(half) <= half.budget_bytes:
            fixes.append(f"--dtype bfloat16 ({weights})")
        elif half_kv_gib is not None:
            tokens = _kv_tokens(half.inputs, half_kv_gib)
            fixes.append(
                f"--dtype bfloat16 --cpu-kv-cache-space {half_kv_gib:g} ({weights}; {tokens:,} KV tokens)"
            )
    return fixes


def _kv_room_gib(plan: MemoryPlan) -> float | None:
    """The largest --cpu-kv-cache-space (in 0.1 GiB) beside the rest of the plan; None when that holds
    less than one request worth running."""
    gib = math.floor((plan.budget_bytes - plan.terms.total) / GiB * 10) / 10
    if gib < MIN_SUGGESTED_KV_GIB:
        return None
    least = min(plan.inputs.max_model_len, MIN_SUGGESTED_KV_TOKENS)
    return gib if _kv_tokens(plan.inputs, gib) >= least else None


def _kv_tokens(inputs: MemoryInputs, kv_gib: float) -> int:
    plan = plan_memory(with_settings(inputs, cpu_kv_cache_space_gib=kv_gib))
    return max(0, plan.num_kv_blocks - 1) * inputs.block_size


def planned_only_notes(args: EngineArgs, model: ModelInfo | None = None) -> list[str]:
    """Settings asked for that the planner sizes but fitserve's engine does not run yet (EngineArgs
    refuses them): `planned only: --quantization fp8 (fitserve runs int4 AWQ / GPTQ checkpoints, not
    this yet; vLLM does)`; and a MoE model's experts quantized (by --quantization or its checkpoint),
    which fitserve's engine refuses before loading."""
    asked = [
        (
            "quantization",
            args.quantization is not None and args.quantization.lower() not in CHECKPOINT_QUANTIZATIONS,
            f"--quantization {args.quantization}",
        ),
    ]
    notes = [
        f"planned only: {flag} ({NOT_RUN_BY_FITSERVE[setting]})" for setting, wanted, flag in asked if wanted
    ]
    quantized_experts = _quantized_experts(args, model) if model is not None and not notes else None
    if quantized_experts:
        notes.append(f"planned only: {quantized_experts} ({MOE_QUANTIZATION})")
    return notes


def _quantized_experts(args: EngineArgs, model: ModelInfo) -> str | None:
    """What would quantize this MoE model's experts (--quantization, or the checkpoint's format), where
    fitserve's engine refuses it; None otherwise."""
    from fitserve.layers.quantization.quant_config import int4_format
    from fitserve.planner.quantized_checkpoint import refuse_quantized_moe_experts

    try:
        fmt = int4_format(model.hf_config, args.quantization)
    except ValueError:  # a format or flag fitserve does not run at all: check_quantization says so
        return None
    try:
        refuse_quantized_moe_experts(model.hf_config, fmt)
    except ValueError:
        return f"--quantization {args.quantization}" if args.quantization else "the checkpoint's quantization"
    return None
