"""A fit result as people read it (a table with the reason for each setting) and as JSON."""

from __future__ import annotations

from typing import Any

from fitserve.kv_layers import describe_kv_layers
from fitserve.planner.fit import FitResult
from fitserve.planner.formats import format_capability, kv_cache_bytes_per_element
from fitserve.planner.hardware import GiB
from fitserve.planner.kv_memory import draft_kv_bytes_per_token, kv_bytes_per_context_token, kv_groups
from fitserve.planner.memory import MemoryPlan
from fitserve.planner.memory_estimates import cpu_kept_forms

_SETTING_WIDTH = 24
_MEMORY_LABEL_WIDTH = 62


def plan_json(result: FitResult) -> dict[str, Any]:
    plan, model = result.plan, result.model
    return {
        "model": {
            "name": model.name,
            "source": model.source,
            "architecture": model.shape.architecture,
            "parameters": model.weights.total_params,
            "active_parameters": model.shape.active_params,
            "towers_not_loaded": list(model.shape.towers),
            "weights_source": model.weights.source,
            "weights_file_bytes": model.weights.file_bytes,
            "max_model_len": model.max_model_len,
        },
        "devices": [
            {
                "kind": device.kind,
                "name": device.name,
                "total_gib": round(device.total_gib, 3),
                "free_gib": round(device.free_gib, 3),
                "capability": format_capability(device.capability) if device.capability else None,
                "assumed": device.assumed,
            }
            for device in result.devices
        ],
        # with tensor parallel, the *_per_gpu numbers are one rank's (on the CPU, one rank process's)
        "tensor_parallel_size": plan.inputs.tensor_parallel_size,
        "budget_gib_per_gpu": round(plan.budget_bytes / GiB, 3),
        "weights_gib_per_gpu": round(plan.weights_gib_per_gpu, 3),
        "weights_offloaded_gib_per_gpu": round(plan.weights_offloaded_bytes / GiB, 3),
        "activation_gib": round(plan.activation_gib, 3),
        "cuda_graph_gib": round(plan.cuda_graph_gib, 3),
        "runtime_overhead_gib": round(plan.runtime_overhead_gib, 3),
        # every layer's K and V for one token; the pool is sized per token of a max_model_len request
        # (sliding-window groups count only their window's blocks: fitserve/kv_groups.py)
        "kv_bytes_per_token": kv_bytes_per_context_token(plan.inputs),
        "kv_bytes_per_request_token": plan.kv_bytes_per_token,
        # speculative decoding's draft model (its weights are in weights_gib_per_gpu, its KV per token
        # in kv_bytes_per_request_token); None without one
        "draft_model": None
        if plan.inputs.draft is None
        else {
            "name": plan.inputs.draft.name,
            "weights_gib": round(plan.inputs.draft.weight_bytes / GiB, 3),
            "kv_bytes_per_token": draft_kv_bytes_per_token(plan.inputs),
        },
        "kv_groups": [
            {
                "sliding_window": group.sliding_window,
                "layers": list(group.layers),
                "blocks_per_request": group.blocks_per_request,
                "num_blocks": count,
            }
            for group, count in zip(kv_groups(plan.inputs), plan.group_num_blocks)
        ],
        "kv_cache_gib_per_gpu": round(plan.kv_cache_gib_per_gpu, 3),
        "num_kv_blocks": plan.num_kv_blocks,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "max_concurrency": round(plan.max_concurrency, 2),
        "cpu_kv_cache": None
        if plan.cpu_kv is None
        else {
            "gib": round(plan.cpu_kv.gib, 3),
            "explicit": plan.cpu_kv.explicit,
            "reason": plan.cpu_kv.reason,
        },
        "settings": resolved_settings(plan),
        "choices": [
            {"setting": c.setting, "value": _jsonable(c.value), "reason": c.reason, "explicit": c.explicit}
            for c in result.choices
        ],
        "notes": list(result.notes),
    }


def resolved_settings(plan: MemoryPlan) -> dict[str, Any]:
    inputs = plan.inputs
    return {
        "device": inputs.device.kind,
        "dtype": inputs.dtype,
        "kv_cache_dtype": inputs.kv_cache_dtype,
        "quantization": inputs.quantization,
        "tensor_parallel_size": inputs.tensor_parallel_size,
        "cpu_offload_gb": inputs.cpu_offload_gb,
        "gpu_memory_utilization": inputs.gpu_memory_utilization,
        "max_model_len": inputs.max_model_len,
        "max_num_batched_tokens": inputs.max_num_batched_tokens,
        "max_num_seqs": inputs.max_num_seqs,
        "block_size": inputs.block_size,
        "cudagraph_capture_sizes": list(inputs.cudagraph_capture_sizes),
        "enforce_eager": inputs.on_gpu and not inputs.cudagraph_capture_sizes,
    }


def _parameters(model: Any) -> str:
    """The model's parameter count; for a quantized checkpoint, whose inventory counts its 16-bit tensors
    only, the whole count from its shape and how many of them are quantized."""
    loaded = model.weights.total_params
    whole = model.shape.parameter_counts().total
    if model.weights.stored_bytes and whole > loaded:
        return f"{whole / 1e9:.2f} B parameters ({(whole - loaded) / 1e9:.2f} B quantized)"
    return f"{loaded / 1e9:.2f} B parameters"


def plan_text(result: FitResult) -> str:
    plan, model = result.plan, result.model
    inputs = plan.inputs
    lines = [
        f"Plan for {model.name or model.source}",
        f"  model    {model.shape.architecture or model.shape.model_type}, "
        f"{_parameters(model)}{_active(model.shape)}, context {model.max_model_len:,} tokens",
        f"  sizes    from {model.weights.source}",
        *_towers_line(model.shape),
        f"  devices  {_devices_line(result)}",
        "",
        "Settings",
    ]
    for choice in result.choices:
        value = _display(choice.value)
        lines.append(f"  {choice.setting:<{_SETTING_WIDTH}} {value:<15} {choice.reason}")
    if inputs.quantization:
        lines.append(f"  {'quantization':<{_SETTING_WIDTH}} {inputs.quantization:<15} set by you")
    if inputs.tensor_parallel_size > 1 and all(c.setting != "tensor_parallel_size" for c in result.choices):
        lines.append(
            f"  {'tensor_parallel_size':<{_SETTING_WIDTH}} {inputs.tensor_parallel_size:<15} set by you"
        )
    if inputs.cpu_offload_gb:
        lines.append(
            f"  {'cpu_offload_gb':<{_SETTING_WIDTH}} {inputs.cpu_offload_gb:<15g} set by you, per GPU"
        )
    lines += ["", *_memory_table(plan), *_kv_lines(plan)]
    if result.notes:
        lines += ["", "Notes", *(f"  - {note}" for note in result.notes)]
    return "\n".join(lines)


def _devices_line(result: FitResult) -> str:
    first = result.devices[0]
    if first.kind == "cpu":
        return first.name
    groups: dict[str, int] = {}
    for device in result.devices:
        sm = f", SM {format_capability(device.capability)}" if device.capability else ""
        free = "" if device.assumed else f", {device.free_gib:.2f} GiB free"
        key = f"{device.name} ({device.total_gib:.2f} GiB{sm}{free})"
        groups[key] = groups.get(key, 0) + 1
    return "; ".join(f"{count} x {key}" for key, count in groups.items())


def _memory_table(plan: MemoryPlan) -> list[str]:
    inputs, terms = plan.inputs, plan.terms
    ranks = inputs.tensor_parallel_size
    if inputs.on_gpu:
        per = "per GPU" if ranks == 1 else f"per GPU (each of the {ranks} tensor-parallel ranks)"
        utilization = inputs.gpu_memory_utilization
        budget = f"budget: {inputs.device.total_gib:.2f} GiB x gpu_memory_utilization {utilization:g}"
    elif ranks > 1:
        per = f"per rank (each of {ranks} CPU ranks, in host RAM)"
        budget = f"RAM available / {ranks} ranks ({inputs.device.free_gib:.2f} GiB in all)"
    else:
        per = "in host RAM"
        budget = "RAM available"
    weights = (
        f"weights ({inputs.weights.total_params / 1e9:.2f} B params, {inputs.quantization or inputs.dtype}"
    )
    stored = inputs.weights.stored_bytes
    if inputs.weights.checkpoint_quantization and stored:
        # a quantized checkpoint: packed codes, zeros, g_idx, fp8 weights and scales as stored; the rest
        # in the dtype
        method = inputs.weights.checkpoint_quantization
        fp8 = "F8_E4M3" in inputs.weights.file_tensor_types
        label = method if method == "fp8" else f"{method} {'fp8' if fp8 else 'int4'}"
        weights += f"; {label} {stored / GiB:.2f} GiB as stored"
    if ranks > 1:
        weights += f", 1/{ranks} per {'GPU' if inputs.on_gpu else 'rank'}"
    if plan.weights_offloaded_bytes:
        weights += f", {plan.weights_offloaded_bytes / GiB:.2f} GiB offloaded"
    forms = cpu_kept_forms(inputs)
    kept = [f"{forms.gguf_type} as int4"] if forms.int4_params else []
    kept += ["fp16 head"] if forms.fp16_head else []  # beside the float32 one
    if kept:
        weights += f"; {', '.join(kept)}"
    if inputs.draft is not None:  # speculative decoding's draft model, on the same device
        weights += f"; draft {_short_name(inputs.draft.name)} {inputs.draft.weight_bytes / GiB:.2f} GiB"
    sizes = inputs.cudagraph_capture_sizes
    graphs = (
        f"CUDA graphs ({len(sizes)} sizes, {min(sizes)}-{max(sizes)})"
        if sizes
        else "CUDA graphs (none: eager)"
    )
    kv_label = "KV cache"
    if plan.cpu_kv is not None:
        kv_label += " (--cpu-kv-cache-space)" if plan.cpu_kv.explicit else " (auto: see below)"
    rows = [
        (budget, plan.budget_bytes),
        (weights + ")", terms.weights),
        (f"activation peak ({inputs.max_num_batched_tokens:,} tokens per step)", terms.activation),
        *([(graphs, terms.cuda_graphs)] if inputs.on_gpu else []),
        ("runtime overhead", terms.runtime_overhead),
        *recurrent_state_rows(plan),
        (kv_label, plan.kv_cache_bytes),
    ]
    header = f"Memory {per}"
    lines = [f"{header:<{_MEMORY_LABEL_WIDTH + 2}}{'GiB':>9}"]
    lines += [f"  {label:<{_MEMORY_LABEL_WIDTH}}{value / GiB:>9.2f}" for label, value in rows]
    return lines


def recurrent_state_rows(plan: MemoryPlan) -> list[tuple[str, int]]:
    """A hybrid model's state pool (worker/recurrent_state.py), before the KV cache; none otherwise."""
    if not plan.recurrent_state_bytes:
        return []
    slots = plan.inputs.max_num_seqs + 1
    rings = plan.inputs.max_num_seqs * plan.inputs.speculative_tokens  # core/state_slots.num_ring_rows
    live = plan.recurrent_state_bytes - plan.state_snapshot_bytes
    per_slot = live / (slots + rings) / (1 << 20)
    ring_bytes = round(live * rings / (slots + rings))
    rows = [(f"recurrent state ({slots} slots x {per_slot:.1f} MiB)", live - ring_bytes)]
    if rings:  # speculative decoding: the rows a verify step keeps the state after each draft in
        rows.append((f"speculative state rows ({rings} x {per_slot:.1f} MiB)", ring_bytes))
    if plan.state_snapshot_bytes:  # --mamba-cache-mode align (core/state_slots.py)
        snapshots = round(plan.state_snapshot_bytes / (live / (slots + rings)))
        rows.append((f"state snapshots ({snapshots} x {per_slot:.1f} MiB)", plan.state_snapshot_bytes))
    return rows


def _short_name(name: str) -> str:
    """A model's folder or hub id as a table names it: the last part (a folder's own name)."""
    return name.rstrip("/").rsplit("/", 1)[-1] or name


def _active(shape: Any) -> str:
    return f" ({shape.active_params / 1e9:.2f} B active per token)" if shape.active_params else ""


def _towers_line(shape: Any) -> list[str]:
    if not shape.towers:
        return []
    return [
        f"  text     weights of the text model only: the {' and '.join(shape.towers)} tower(s) are not loaded"
    ]


def _kv_lines(plan: MemoryPlan) -> list[str]:
    inputs = plan.inputs
    shape = inputs.shape
    heads = shape.kv_heads_per_rank(inputs.tensor_parallel_size)
    element = kv_cache_bytes_per_element(inputs.kv_cache_dtype, inputs.dtype)
    per_token = plan.kv_bytes_per_token / 1024
    if shape.kv_layers:
        formula = describe_kv_layers(shape.kv_layers, element)
    else:
        layers = plan.num_layers_held  # a pipeline stage's, else the model's
        formula = f"2 (K, V) x {layers} layers x {heads} KV heads x {shape.head_dim} x {element} bytes"
    if inputs.draft is not None:
        formula += (
            f", + the draft model's {draft_kv_bytes_per_token(inputs) / 1024:g} KiB "
            f"({_short_name(inputs.draft.name)}, a pool of as many blocks)"
        )
    if inputs.tensor_parallel_size > 1:
        # each rank keeps every token's K and V for its share of the KV heads
        rank = "GPU" if inputs.on_gpu else "rank"
        formula += f" per {rank} ({shape.num_kv_heads} KV heads over {inputs.tensor_parallel_size} ranks)"
    groups = kv_groups(inputs)
    if len(groups) > 1:
        return [
            f"KV cache: {plan.kv_cache_tokens:,} tokens of max_model_len requests; {per_token:g} KiB per "
            f"token of a {inputs.max_model_len:,}-token request, where a sliding group keeps only its "
            f"window's blocks (every layer's whole context: {kv_bytes_per_context_token(inputs) / 1024:g} "
            f"KiB per token = {formula})",
            *_group_lines(plan, groups, element),
            f"Maximum concurrency for {inputs.max_model_len:,} tokens per request: "
            f"{plan.max_concurrency:.2f}x",
            *([plan.cpu_kv.log_line()] if plan.cpu_kv is not None else []),
        ]
    return [
        f"KV cache: {plan.kv_cache_tokens:,} tokens in {plan.num_kv_blocks:,} blocks of {inputs.block_size} "
        f"(one reserved); {per_token:g} KiB per token = {formula}",
        f"Maximum concurrency for {inputs.max_model_len:,} tokens per request: {plan.max_concurrency:.2f}x",
        *([plan.cpu_kv.log_line()] if plan.cpu_kv is not None else []),
    ]


def _group_lines(plan: MemoryPlan, groups: tuple, element: int) -> list[str]:
    """One line per KV cache group: its layers, window, blocks per full-length request and pool."""
    lines = []
    for group, count in zip(groups, plan.group_num_blocks):
        kind = f"sliding window {group.sliding_window:,}" if group.is_sliding else "full attention"
        block_kib = group.elements_per_token * element * plan.inputs.block_size / 1024
        lines.append(
            f"  {kind}: {len(group.layers)} layers, {group.blocks_per_request:,} blocks a request at most, "
            f"{count:,} blocks of {block_kib:g} KiB (one reserved)"
        )
    return lines


def _display(value: Any) -> str:
    if isinstance(value, tuple | list):
        if not value:
            return "none"
        return (
            f"{len(value)} sizes {min(value)}-{max(value)}" if len(value) > 3 else ", ".join(map(str, value))
        )
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}" if value >= 10000 else str(value)
    return str(value)


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
