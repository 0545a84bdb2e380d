"""Auto-fit: fill in what the user left unset, say why for each choice, and refuse before loading
what cannot fit, naming the numbers and what would.

Explicit settings always win: `explicit` names the EngineArgs fields the user set (flags or YAML
keys); only the others are chosen here. The result's plan holds every resolved value; planner/resolve.py
turns it into the engine's config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fitserve.args import EngineArgs
from fitserve.config import DEFAULT_GPU_MEMORY_UTILIZATION, Choice
from fitserve.cpu_kv_cache import FULL_LENGTH_REQUESTS, RAM_FRACTION
from fitserve.kv_layers import cuda_graphs_unsupported
from fitserve.planner.draft_plan import with_draft
from fitserve.planner.fit_errors import (
    PlanError,
    check_block_size,
    check_devices,
    check_fp8_experts,
    check_fp8_kv_cache_on_gpu,
    check_host_memory,
    check_quantization,
    kv_cache_error,
    utilization_error,
    weights_error,
)
from fitserve.planner.fit_knobs import (
    auto_settings,
    capped,
    default_max_num_batched_tokens,
    display_setting,
    initial_capture_sizes,
    shrink_to_fit,
)
from fitserve.planner.fit_options import Headroom
from fitserve.planner.fit_parallel import AUTO_TP_REQUESTS, auto_sizes, size_problem
from fitserve.planner.formats import BF16_MIN_CAPABILITY, canonical_dtype, format_capability
from fitserve.planner.hardware import DeviceSpec, GiB
from fitserve.planner.kv_length import largest_length
from fitserve.planner.kv_memory import kv_groups
from fitserve.planner.memory import MemoryPlan, plan_memory
from fitserve.planner.memory_estimates import cpu_kept_forms, weight_bytes_per_gpu
from fitserve.planner.memory_inputs import MemoryInputs, with_settings
from fitserve.planner.model_info import ModelInfo
from fitserve.planner.model_shape import ModelShape
from fitserve.spec_decode.config import SpeculativeConfig, check_speculative_model, parse_speculative_config

# The model's own max_model_len is kept when the KV cache holds FULL_LENGTH_REQUESTS (2) requests of that
# length (one long request then never stalls all the others); else the largest length that many fit. The
# constant lives with the CPU's automatic KV cache (fitserve/cpu_kv_cache.py), which holds as many.
# An automatic max_model_len is never below min(the model's own, this).
MIN_AUTO_MAX_MODEL_LEN = 1024
# With max_model_len unset, the weights must leave KV room for one request of min(own, this) tokens.
REFERENCE_CONTEXT = 4096

__all__ = ["Choice", "FitResult", "PlanError", "auto_fit"]


@dataclass(frozen=True)
class FitResult:
    plan: MemoryPlan
    model: ModelInfo
    devices: tuple[DeviceSpec, ...]  # the devices the plan uses
    choices: tuple[Choice, ...]
    notes: tuple[str, ...]


def auto_fit(
    model: ModelInfo,
    args: EngineArgs,
    devices: Sequence[DeviceSpec],
    explicit: frozenset[str] = frozenset(),
    host_ram_available: int | None = None,
    serving: bool = True,
) -> FitResult:
    """Raises PlanError (a ValueError) when the model cannot run as asked, with the fix. `serving`: plan
    for `fitserve serve` (its defaults), else for offline generation (`fitserve generate`, LLM).
    tensor_parallel_size, unset with several GPUs visible, is auto-fit's (planner/fit_parallel.py)."""
    user_tp = (
        "tensor_parallel_size" in explicit
        or args.tensor_parallel_size != 1
        or args.pipeline_parallel_size > 1
    )
    on_gpus = bool(devices) and devices[0].kind == "cuda"
    if on_gpus and args.data_parallel_size > 1 and not user_tp:
        # each data-parallel engine is planned on its share of the GPUs, as `fitserve serve` starts it
        devices = devices[: max(1, len(devices) // args.data_parallel_size)]
    if user_tp or not on_gpus or len(devices) == 1:
        result = _fit_at(model, args, devices, explicit, host_ram_available, serving)
        if user_tp or len(devices) > 1:
            result = _with_tp_choice(result, _explicit_tp_choice(result))
        return result
    return _auto_tensor_parallel(model, args, devices, explicit, host_ram_available, serving)


# A plan that does not fit at one tensor-parallel size may fit at another; other refusals hold for all.
_MEMORY_REFUSALS = ("weights", "kv_cache", "host_memory")


def _auto_tensor_parallel(
    model: ModelInfo,
    args: EngineArgs,
    devices: Sequence[DeviceSpec],
    explicit: frozenset[str],
    host_ram_available: int | None,
    serving: bool,
) -> FitResult:
    """The smallest size of auto_sizes whose plan holds AUTO_TP_REQUESTS requests; else the one whose KV
    cache holds the most tokens; else (none fits) the largest size's refusal."""
    needed = args.max_model_len or min(model.max_model_len, REFERENCE_CONTEXT)
    tried: list[tuple[int, FitResult | PlanError]] = []
    for size in auto_sizes(model.shape, devices):
        try:
            result = _fit_at(
                model,
                dataclasses.replace(args, tensor_parallel_size=size),
                devices,
                explicit,
                host_ram_available,
                serving,
            )
        except PlanError as error:
            if error.kind not in _MEMORY_REFUSALS:
                raise
            tried.append((size, error))
            continue
        tried.append((size, result))
        if result.plan.kv_cache_tokens >= AUTO_TP_REQUESTS * needed:
            break
    fitted = [(size, r) for size, r in tried if isinstance(r, FitResult)]
    if not fitted:
        raise tried[-1][1]  # type: ignore[misc]  # every try raised: the widest one's refusal
    size, result = fitted[-1]  # the tries stop at the first that holds the batch
    if result.plan.kv_cache_tokens < AUTO_TP_REQUESTS * needed:  # none does: the most tokens, fewest ranks
        size, result = max(fitted, key=lambda pair: pair[1].plan.kv_cache_tokens)
    return _with_tp_choice(
        result, Choice("tensor_parallel_size", size, _auto_tp_reason(tried, result, needed, devices))
    )


def _auto_tp_reason(
    tried: list[tuple[int, FitResult | PlanError]],
    chosen: FitResult,
    needed: int,
    devices: Sequence[DeviceSpec],
) -> str:
    plan = chosen.plan
    size = plan.inputs.tensor_parallel_size
    wanted = f"{AUTO_TP_REQUESTS} wanted"

    def holds(result: FitResult) -> str:
        tokens = result.plan.kv_cache_tokens
        return f"{tokens:,} KV tokens, {tokens / needed:.1f} requests of {needed:,} tokens"

    if size == 1:
        others = "the other GPU stays" if len(devices) == 2 else f"the other {len(devices) - 1} GPUs stay"
        return (
            f"one GPU holds the weights ({plan.weights_gib_per_gpu:.2f} GiB) and {holds(chosen)} (at "
            f"least {wanted}); {others} unused"
        )
    first_size, first = tried[0]
    if isinstance(first, FitResult):
        one = (
            f"on one GPU the weights ({first.plan.weights_gib_per_gpu:.2f} GiB) leave {holds(first)} "
            f"(fewer than {wanted})"
        )
    else:
        weights = weight_bytes_per_gpu(with_settings(plan.inputs, tensor_parallel_size=first_size)) / GiB
        one = f"the weights ({weights:.2f} GiB) leave one GPU no room for a {needed:,}-token request"
    each = f"{size} GPUs hold {plan.weights_gib_per_gpu:.2f} GiB of weights each and {holds(chosen)}"
    if plan.kv_cache_tokens < AUTO_TP_REQUESTS * needed:
        each += f", the most the {len(devices)} GPUs present hold (fewer than {wanted})"
    return f"{one}; {each}"


def _explicit_tp_choice(result: FitResult) -> Choice:
    inputs = result.plan.inputs
    size = inputs.tensor_parallel_size
    if inputs.on_gpu:
        return Choice("tensor_parallel_size", size, "set by you", explicit=True)
    reason = (
        f"set by you: {size} CPU ranks (processes, gloo), each holding 1/{size} of the weights and of the KV "
        "heads, sharing the RAM"
    )
    return Choice("tensor_parallel_size", size, reason, explicit=True)


def _with_tp_choice(result: FitResult, choice: Choice) -> FitResult:
    """`result` with tensor_parallel_size's choice first (it shapes every other)."""
    return dataclasses.replace(result, choices=(choice, *result.choices))


def _fit_at(
    model: ModelInfo,
    args: EngineArgs,
    devices: Sequence[DeviceSpec],
    explicit: frozenset[str],
    host_ram_available: int | None,
    serving: bool,
) -> FitResult:
    """auto_fit at args.tensor_parallel_size."""
    used = check_devices(args, devices, model.shape)
    check_block_size(args.block_size, used)
    device = min(used, key=lambda d: (d.total_bytes, d.free_bytes))
    on_gpu = device.kind == "cuda"
    choices: list[Choice] = []
    dtype = _choose_dtype(args, model, used, choices)
    check_quantization(args.quantization, model, used)
    check_fp8_experts(model, used, args.quantization)
    for gpu in used:
        if gpu.kind == "cuda" and gpu.capability is not None:
            try:
                check_fp8_kv_cache_on_gpu(args.kv_cache_dtype, gpu.capability)
            except ValueError as error:
                raise PlanError("kv_cache_dtype", f"{gpu.label()}: {error}") from None
    utilization = (
        _choose_utilization(args, used, explicit, choices) if on_gpu else args.gpu_memory_utilization
    )
    if args.max_model_len is not None and args.max_model_len > model.max_model_len:
        raise PlanError(
            "max_model_len",
            f"max_model_len={args.max_model_len} is above the model's own limit {model.max_model_len}: "
            f"set --max-model-len {model.max_model_len} or less",
        )
    batched = args.max_num_batched_tokens or default_max_num_batched_tokens(
        device.kind, args.max_num_seqs, serving
    )
    inputs = MemoryInputs(
        shape=model.shape,
        weights=model.weights,
        device=device,
        dtype=dtype,
        max_model_len=args.max_model_len or model.max_model_len,
        max_num_batched_tokens=batched,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        cpu_offload_gb=float(args.cpu_offload_gb) if on_gpu else 0.0,
        gpu_memory_utilization=utilization,
        cudagraph_capture_sizes=(
            initial_capture_sizes(args, on_gpu, model.shape.model_type)
            if args.pipeline_parallel_size == 1
            else ()  # pipeline stages run eagerly
        ),
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        cpu_kv_cache_space_gib=None if args.cpu_kv_cache_space is None else float(args.cpu_kv_cache_space),
        mamba_cache_mode=resolve_mamba_cache_mode(args, model.shape),
    )
    # a draft model (speculative decoding) shares the device: its weights and KV per token are counted
    inputs = with_draft(inputs, args.speculative_config, args.trust_remote_code, args.load_format)
    needed = args.max_model_len or min(model.max_model_len, REFERENCE_CONTEXT)
    auto = auto_settings(args, explicit)
    headroom = Headroom(
        max_utilization=min(d.free_bytes / d.total_bytes for d in used) if on_gpu else 1.0,
        num_gpus=len(devices) if on_gpu else 0,
        host_ram_available=host_ram_available,
        fewer_sequences="max_num_seqs" in auto,
    )
    shrink_reasons: dict[str, str] = {}
    if args.num_gpu_blocks_override is None:  # a fixed pool (a testing knob) shrinks nothing
        inputs, shrink_reasons = shrink_to_fit(inputs, needed, auto)
    plan = plan_memory(inputs)
    if plan.free_for_kv_bytes < 2 * plan.block_bytes and args.num_gpu_blocks_override is None:
        raise weights_error(plan, needed, headroom)
    adjusted = [f"{name} to {display_setting(getattr(inputs, name))}" for name in shrink_reasons]
    max_model_len, length_reason = _choose_length(plan, model, args, headroom, adjusted)
    inputs = with_settings(inputs, max_model_len=max_model_len)
    num_seqs, seqs_reason = _choose_num_seqs(inputs, auto, shrink_reasons)
    if num_seqs != inputs.max_num_seqs:
        inputs = with_settings(
            inputs, max_num_seqs=num_seqs, cudagraph_capture_sizes=capped(inputs, num_seqs)
        )
    plan = plan_memory(inputs)
    check_host_memory(plan, host_ram_available)
    _check_speculation(args.speculative_config, inputs)
    choices += _late_choices(plan, args, explicit, shrink_reasons, length_reason, seqs_reason, serving)
    return FitResult(
        plan=plan,
        model=model,
        devices=tuple(used),
        choices=tuple(choices),
        notes=tuple(_notes(plan, model, args, devices)),
    )


def _check_speculation(speculative: Any, inputs: MemoryInputs) -> None:
    """The engine's refusal of a speculative method for this model (spec_decode/config.py), with the
    KV cache groups of the max_model_len chosen: `fitserve plan` says it before `serve` would."""
    if not isinstance(speculative, SpeculativeConfig):
        speculative = parse_speculative_config(speculative)
    if speculative is not None:
        check_speculative_model(speculative, kv_groups(inputs))


def resolve_mamba_cache_mode(args: EngineArgs, shape: ModelShape) -> str:
    """--mamba-cache-mode for this model: none without prefix caching or without recurrent layers; all is
    refused for a hybrid (core/state_slots.py keeps states where steps end, not at every boundary)."""
    hybrid = bool(shape.recurrent_state_elements)
    if not args.enable_prefix_caching or not hybrid:
        return "none"
    if args.mamba_cache_mode == "all":
        raise ValueError(
            f"--mamba-cache-mode all is not supported for {shape.architecture or 'this hybrid model'}: its "
            "linear-attention state is kept only where a step ends on a block boundary (vLLM caches "
            "Qwen3.5's Gated DeltaNet in align mode only); use --mamba-cache-mode align (the default) or none"
        )
    return args.mamba_cache_mode


def _choose_dtype(
    args: EngineArgs, model: ModelInfo, used: Sequence[DeviceSpec], choices: list[Choice]
) -> str:
    device = used[0]
    capabilities = [d.capability for d in used if d.capability is not None]
    oldest = min(capabilities) if capabilities else None
    if args.dtype != "auto":
        dtype = canonical_dtype(args.dtype)
        if dtype == "bfloat16" and oldest is not None and oldest < BF16_MIN_CAPABILITY:
            raise PlanError(
                "dtype",
                f"dtype=bfloat16 needs compute capability 8.0, {device.label()} has "
                f"{format_capability(oldest)}: set --dtype half",
            )
        choices.append(Choice("dtype", dtype, "set by you", explicit=True))
        return dtype
    if device.kind == "cpu":
        choices.append(Choice("dtype", "float32", "auto on the CPU: bf16 matmuls are slow on most CPUs"))
        return "float32"
    model_dtype = model.shape.torch_dtype
    dtype = "float16" if model_dtype in ("float16", "half") else "bfloat16"
    if model_dtype in ("float16", "bfloat16"):
        reason = f"the model's {model_dtype}"
    else:
        reason = f"bf16 for a {model_dtype} model" if model_dtype else "bf16 (config.json names no dtype)"
    if dtype == "bfloat16" and oldest is not None and oldest < BF16_MIN_CAPABILITY:
        dtype = "float16"
        reason = f"fp16: the GPU's compute capability {format_capability(oldest)} is below 8.0 (no fast bf16)"
    elif oldest is None:
        reason += "; GPU capability unknown, taken as 8.0+ (add @SM to --assume-gpus for an older GPU)"
    else:
        reason += f"; SM {format_capability(oldest)} runs it natively"
    choices.append(Choice("dtype", dtype, reason))
    return dtype


def _choose_utilization(
    args: EngineArgs, used: Sequence[DeviceSpec], explicit: frozenset[str], choices: list[Choice]
) -> float:
    tightest = min(used, key=lambda d: d.free_bytes / d.total_bytes)
    fits = math.floor(tightest.free_bytes / tightest.total_bytes * 100) / 100
    if "gpu_memory_utilization" in explicit:
        asked = args.gpu_memory_utilization
        if asked * tightest.total_bytes > tightest.free_bytes:
            raise utilization_error(asked, tightest, fits)
        choices.append(Choice("gpu_memory_utilization", asked, "set by you", explicit=True))
        return asked
    default = DEFAULT_GPU_MEMORY_UTILIZATION
    if default * tightest.total_bytes <= tightest.free_bytes:
        reason = (
            f"default: {default * tightest.total_gib:.2f} of {tightest.total_gib:.2f} GiB; "
            f"{tightest.free_gib:.2f} GiB is free"
        )
        choices.append(Choice("gpu_memory_utilization", default, reason))
        return default
    if fits < 0.05:
        raise utilization_error(default, tightest, fits)
    held = (tightest.total_bytes - tightest.free_bytes) / GiB
    reason = (
        f"other processes hold {held:.2f} GiB of {tightest.label()}; {default} would need "
        f"{default * tightest.total_gib:.2f} GiB but {tightest.free_gib:.2f} GiB is free"
    )
    choices.append(Choice("gpu_memory_utilization", fits, reason))
    return fits


def _choose_max_model_len(
    plan: MemoryPlan, model: ModelInfo, args: EngineArgs, headroom: Headroom, adjusted: list[str]
) -> tuple[int, str]:
    block = plan.inputs.block_size
    usable_blocks = max(0, plan.num_kv_blocks - 1)
    usable_tokens = usable_blocks * block
    fixed_pool = plan.inputs.num_gpu_blocks_override is not None  # a testing knob: nothing is sized to it
    if args.max_model_len is not None:
        if math.ceil(args.max_model_len / block) > usable_blocks and not fixed_pool:
            raise kv_cache_error(plan, args.max_model_len, headroom, adjusted)
        return args.max_model_len, "set by you"
    own = model.max_model_len
    own_blocks = math.ceil(own / block)
    if fixed_pool:
        return own, (
            f"the model's own; --num-gpu-blocks-override fixes the KV cache at {usable_tokens:,} tokens "
            "(requests that outgrow it are preempted and recomputed)"
        )
    if FULL_LENGTH_REQUESTS * own_blocks <= usable_blocks:
        return (
            own,
            f"the model's own; the KV cache ({usable_tokens:,} tokens) holds "
            f"{usable_blocks / own_blocks:.1f}x",
        )
    floor = min(own, MIN_AUTO_MAX_MODEL_LEN)
    for requests in (FULL_LENGTH_REQUESTS, 1):
        length = largest_length(plan, requests, own)
        if length >= floor:
            fit = (
                f"that {requests} requests fit"
                if requests > 1
                else "that fits (one request at a time at full length)"
            )
            return length, (
                f"the model's own {own:,} fits {usable_blocks / own_blocks:.2f}x in the KV cache "
                f"({usable_tokens:,} tokens): lowered to the largest length {fit}"
            )
    raise kv_cache_error(plan, floor, headroom, adjusted)


def _choose_length(
    plan: MemoryPlan, model: ModelInfo, args: EngineArgs, headroom: Headroom, adjusted: list[str]
) -> tuple[int, str]:
    """max_model_len. On the CPU with --cpu-kv-cache-space unset, the KV cache follows max_model_len
    (fitserve/cpu_kv_cache.py) up to its RAM cap: an unset max_model_len keeps the model's own while one
    request of it fits under the cap, else is lowered as on a GPU, against the cap."""
    size = plan.cpu_kv
    if args.max_model_len is not None or size is None or not size.capped or size.cap_blocks is None:
        return _choose_max_model_len(plan, model, args, headroom, adjusted)
    available = size.available_bytes or 0
    ram = f"{RAM_FRACTION:.0%} of the {available / GiB:.1f} GiB of RAM the weights leave"
    if size.ranks > 1:
        ram += f", split between {size.ranks} ranks"
    if size.cap_blocks - 1 >= math.ceil(model.max_model_len / plan.inputs.block_size):
        held = f"{size.tokens:,} tokens, at most {ram}"
        return model.max_model_len, f"the model's own; the KV cache ({held}) holds {size.requests:.1f}x"
    cap = size.cap_blocks
    probe = dataclasses.replace(plan, num_kv_blocks=cap, kv_cache_bytes=cap * plan.block_bytes)
    length, reason = _choose_max_model_len(probe, model, args, headroom, adjusted)
    return length, f"{reason}; on the CPU the KV cache takes at most {ram}"


def _choose_num_seqs(
    inputs: MemoryInputs, auto: frozenset[str], shrink_reasons: dict[str, str]
) -> tuple[int, str]:
    """Unset: at most as many as there are KV blocks (every running request holds at least one); fewer
    sequences free sampler and graph memory, so the largest count that its own plan can hold is taken."""
    seqs = inputs.max_num_seqs
    if "max_num_seqs" not in auto:
        return seqs, "set by you"
    if inputs.num_gpu_blocks_override is not None:
        return seqs, "default; --num-gpu-blocks-override fixes the KV cache, so it is not sized to it"

    def usable_blocks(count: int) -> int:
        changed = with_settings(inputs, max_num_seqs=count, cudagraph_capture_sizes=capped(inputs, count))
        return plan_memory(changed).num_kv_blocks - 1

    if usable_blocks(seqs) >= seqs:
        if "max_num_seqs" in shrink_reasons:
            return seqs, shrink_reasons["max_num_seqs"]
        concurrency = plan_memory(inputs).max_concurrency
        return seqs, f"default; the KV cache holds {concurrency:.1f} requests of max_model_len at once"
    low, high = 1, seqs
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if usable_blocks(middle) >= middle else (low, middle - 1)
    return low, (
        f"lowered from {seqs} to {low}: the KV cache has {usable_blocks(low)} blocks and every running "
        "request holds at least one"
    )


def _late_choices(
    plan: MemoryPlan,
    args: EngineArgs,
    explicit: frozenset[str],
    shrink_reasons: dict[str, str],
    length_reason: str,
    seqs_reason: str,
    serving: bool,
) -> list[Choice]:
    inputs = plan.inputs
    choices = [
        Choice("max_model_len", inputs.max_model_len, length_reason, args.max_model_len is not None),
        Choice("max_num_seqs", inputs.max_num_seqs, seqs_reason, "max_num_seqs" in explicit),
    ]
    if args.max_num_batched_tokens is not None:
        choices.append(Choice("max_num_batched_tokens", inputs.max_num_batched_tokens, "set by you", True))
    else:
        default = "default: the token budget of one step"
        if serving and inputs.on_gpu:
            default = "default for serving: short prefill chunks keep first and next tokens coming"
        default = shrink_reasons.get("max_num_batched_tokens", default)
        choices.append(Choice("max_num_batched_tokens", inputs.max_num_batched_tokens, default))
    if inputs.on_gpu:
        sizes = inputs.cudagraph_capture_sizes
        unsupported = cuda_graphs_unsupported(inputs.shape.model_type)
        if args.enforce_eager:
            choices.append(Choice("cudagraph_capture_sizes", (), "--enforce-eager: no CUDA graphs", True))
        elif unsupported:
            choices.append(Choice("cudagraph_capture_sizes", (), f"none: {unsupported}"))
        elif args.pipeline_parallel_size > 1:
            choices.append(Choice("cudagraph_capture_sizes", (), "none: pipeline stages run eagerly"))
        elif args.compilation_config is not None:
            choices.append(
                Choice("cudagraph_capture_sizes", sizes, "set by you (--compilation-config)", True)
            )
        else:
            reason = shrink_reasons.get(
                "cudagraph_capture_sizes", f"vLLM's ladder up to max_num_seqs {inputs.max_num_seqs}"
            )
            choices.append(Choice("cudagraph_capture_sizes", sizes, reason))
    kv_reason = "set by you" if args.kv_cache_dtype != "auto" else f"auto: the model dtype ({inputs.dtype})"
    choices.append(Choice("kv_cache_dtype", inputs.kv_cache_dtype, kv_reason, args.kv_cache_dtype != "auto"))
    return choices


def _notes(plan: MemoryPlan, model: ModelInfo, args: EngineArgs, devices: Sequence[DeviceSpec]) -> list[str]:
    from fitserve.planner.fit_errors import planned_only_notes

    inputs = plan.inputs
    notes = list(plan.notes) + planned_only_notes(args, model)
    weights = model.weights
    if weights.source.startswith("GGUF") and weights.file_bytes is not None:
        int4 = cpu_kept_forms(inputs).int4_params
        kept = f", the CPU engine keeps its {weights.cpu_forms.gguf_type} matrices int4" if int4 else ""
        notes.append(
            f"the GGUF file stores {', '.join(weights.file_tensor_types)} "
            f"({weights.file_bytes / GiB:.2f} GiB); fitserve dequantizes it to {inputs.dtype}{kept}: "
            f"{plan.weights_bytes_per_gpu_before_offload / GiB:.2f} GiB in memory"
        )
    replicas = args.data_parallel_size
    if replicas > 1:
        tp = inputs.tensor_parallel_size
        where = "in its own process"
        if inputs.on_gpu:
            where = f"on {tp} GPU(s) of its own ({replicas * tp} in all)"
        notes.append(
            f"data_parallel_size {replicas}: `fitserve serve` runs {replicas} engines like this one, each "
            f"{where}; every number above is one engine's (docs/distributed.md)"
        )
    if inputs.on_gpu and replicas == 1 and len(devices) > inputs.world_size:
        size = len(devices)
        if size_problem(model.shape, size) is None:
            wider = plan_memory(with_settings(inputs, tensor_parallel_size=size))
            notes.append(
                f"{len(devices)} GPUs present, tensor_parallel_size {inputs.tensor_parallel_size} uses "
                f"{inputs.tensor_parallel_size}: --tensor-parallel-size {size} would give "
                f"{wider.kv_cache_tokens:,} KV tokens"
            )
    if not inputs.on_gpu and inputs.tensor_parallel_size > 1:
        ranks = inputs.tensor_parallel_size
        notes.append(
            f"tensor_parallel_size {ranks} on the CPU: {ranks} ranks (processes) exchange activations with "
            f"gloo; each holds 1/{ranks} of the weights and of the KV heads, and the memory above is one "
            f"rank's, planned in 1/{ranks} of the RAM available (the ranks share the cores too)"
        )
    if not inputs.on_gpu:
        notes.append(
            "on the CPU gpu_memory_utilization has no effect: the KV cache is --cpu-kv-cache-space GiB, or, "
            f"unset, {FULL_LENGTH_REQUESTS} requests of max_model_len within {RAM_FRACTION:.0%} of the RAM "
            "available"
        )
    return notes
