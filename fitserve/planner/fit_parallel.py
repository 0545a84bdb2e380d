"""Tensor parallel in the plan: which sizes a model takes, the devices a size needs, and auto-fit's size.

A size works when it divides the attention heads and, for every KV head count of the model (Gemma-4's
layers have two), is a divisor of it (the heads are split) or a multiple of it (each head is replicated
on size / heads ranks), as fitserve/layers/tp_shards.py shards them. Ranks run on alike GPUs (the same
name and memory: the plan sizes every rank alike), or as processes on the CPU with gloo.

Auto-fit (`--tensor-parallel-size` unset, more than one GPU visible) takes the smallest power of two that
works and holds a useful batch: a KV cache of at least AUTO_TP_REQUESTS (4) requests of the length
auto-fit plans for (--max-model-len when set, else min(the model's own, 4,096) tokens). One GPU that holds
them keeps tensor_parallel_size 1; when no size does, the size holding the most tokens is taken.

Pipeline parallel (--pipeline-parallel-size, never chosen by auto-fit) splits the decoder layers of the
families built on models/decoder_blocks.py into contiguous stages (distributed/pipeline.py), each stage
tensor_parallel_size GPUs: tensor_parallel_size x pipeline_parallel_size GPUs in all.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fitserve.distributed.pipeline import stage_layer_ranges
from fitserve.kv_layers import GEMMA4_MODEL_TYPES, QWEN3_5_MODEL_TYPES
from fitserve.planner.hardware import DeviceSpec
from fitserve.planner.model_shape import ModelShape

# The useful batch: auto-fit widens tensor parallel until the KV cache holds this many requests.
AUTO_TP_REQUESTS = 4
# GPUs count as alike when their names match and their memory is within this fraction (ECC, reserved
# memory and driver versions move the total a little between cards of one model).
ALIKE_MEMORY_TOLERANCE = 0.01


def kv_head_counts(shape: ModelShape) -> tuple[int, ...]:
    """Every KV head count of the model's layers (one, unless the layers differ as Gemma-4's do)."""
    if shape.kv_layers:
        return tuple(sorted({spec.num_kv_heads for spec in shape.kv_layers}))
    return (shape.num_kv_heads,)


def size_problem(shape: ModelShape, size: int) -> str | None:
    """Why `size` ranks cannot split the model, or None when they can."""
    heads = shape.num_attention_heads
    if heads % size:
        return f"does not divide the model's {heads} attention heads"
    for kv_heads in kv_head_counts(shape):
        if kv_heads % size and size % kv_heads:
            return f"is neither a divisor nor a multiple of the model's {kv_heads} KV heads"
    for linear_heads in shape.linear_head_counts:  # Gated DeltaNet heads are split, never replicated
        if linear_heads % size:
            return f"does not divide the model's {linear_heads} linear-attention (Gated DeltaNet) heads"
    return None


def pipeline_refusal(model_type: str, num_layers: int, pipeline_parallel_size: int) -> str | None:
    """Why the model cannot run in `pipeline_parallel_size` stages, or None when it can."""
    stages = pipeline_parallel_size
    if stages == 1:
        return None
    family = None
    if model_type in GEMMA4_MODEL_TYPES or model_type == "gemma4_text":
        family = "Gemma-4 (its KV-shared layers read the caches of earlier layers, another stage's)"
    elif model_type in QWEN3_5_MODEL_TYPES:
        family = "Qwen3.5 / Qwen3.6 (its recurrent-state pool holds every Gated DeltaNet layer)"
    if family is not None:
        return (
            f"pipeline_parallel_size={stages} does not run {family} yet: set --pipeline-parallel-size 1 "
            "and split it with --tensor-parallel-size; pipeline parallel runs the Llama, Mistral, Qwen2 "
            "and Qwen3 families"
        )
    try:
        stage_layer_ranges(num_layers, stages)
    except ValueError as error:
        return str(error)
    return None


def working_sizes(shape: ModelShape, limit: int) -> list[int]:
    """The sizes from 1 to `limit` that split the model."""
    return [size for size in range(1, limit + 1) if size_problem(shape, size) is None]


def size_refusal(shape: ModelShape, size: int) -> str | None:
    """The refusal of a size that cannot split the model, naming the nearest sizes that can."""
    problem = size_problem(shape, size)
    if problem is None:
        return None
    sizes = working_sizes(shape, max(shape.num_attention_heads, size))
    below = [n for n in sizes if n < size][-1:]
    above = [n for n in sizes if n > size][:1]
    nearest = " or ".join(str(n) for n in below + above)
    fix = f"set --tensor-parallel-size {nearest} (the nearest that work)"
    return f"tensor_parallel_size={size} {problem}: {fix}"


def alike(first: DeviceSpec, other: DeviceSpec) -> bool:
    if first.name != other.name:
        return False
    return abs(first.total_bytes - other.total_bytes) <= ALIKE_MEMORY_TOLERANCE * first.total_bytes


def alike_prefix(devices: Sequence[DeviceSpec]) -> int:
    """How many of the first devices are alike the first one."""
    count = 0
    for device in devices:
        if not alike(devices[0], device):
            break
        count += 1
    return count


def auto_sizes(shape: ModelShape, devices: Sequence[DeviceSpec]) -> list[int]:
    """The sizes auto-fit tries, smallest first: powers of two that split the model, on alike GPUs."""
    limit = alike_prefix(devices)
    sizes, size = [], 1
    while size <= limit:
        if size_problem(shape, size) is None:
            sizes.append(size)
        size *= 2
    return sizes or [1]


def visible_devices_hint(indices: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES naming the GPUs at torch's `indices`: the entries of the variable when it is
    already set (torch numbers the GPUs it lists from 0), else the indices themselves."""
    variable = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    listed = [entry.strip() for entry in variable.split(",") if entry.strip()]
    names = [listed[i] if i < len(listed) else str(i) for i in indices]
    return f"CUDA_VISIBLE_DEVICES={','.join(names)}"


def mismatch_refusal(
    size: int, devices: Sequence[DeviceSpec], shape: ModelShape, stages: int = 1
) -> str | None:
    """The refusal when the first `size` GPUs are not alike, naming a set of alike ones if there is one.
    With pipeline stages `size` is every rank's count (tensor_parallel_size x stages)."""
    used = devices[:size]
    different = next((device for device in used if not alike(used[0], device)), None)
    if different is None:
        return None
    asked = f"tensor_parallel_size={size}"
    if stages > 1:
        asked = f"tensor_parallel_size={size // stages} x pipeline_parallel_size={stages}"
    head = (
        f"{asked} needs {size} alike GPUs (each rank is planned alike), but "
        f"{used[0].label()} and {different.label()} differ"
    )
    if used[0].assumed:
        return f"{head}: plan for alike GPUs with --assume-gpus {size}x{used[0].total_gib:g}"
    found = next((group[:size] for group in alike_groups(devices) if len(group) >= size), None)
    if found is not None:
        fix = f"set {visible_devices_hint([device.index for device in found])} (alike GPUs)"
    else:
        fix = f"set CUDA_VISIBLE_DEVICES to {size} alike GPUs"
    if stages > 1:
        return f"{head}: {fix}"
    fewer = working_sizes(shape, min(alike_prefix(devices), size - 1))[-1]
    return f"{head}: {fix}, or --tensor-parallel-size {fewer} (the alike GPUs first in the list)"


def alike_groups(devices: Sequence[DeviceSpec]) -> list[list[DeviceSpec]]:
    """The devices grouped alike with alike, largest group first (the earlier one on a tie)."""
    groups: list[list[DeviceSpec]] = []
    for device in devices:
        group = next((g for g in groups if alike(g[0], device)), None)
        if group is None:
            groups.append([device])
        else:
            group.append(device)
    return sorted(groups, key=lambda group: -len(group))
