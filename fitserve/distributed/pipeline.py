"""Pipeline parallel: which decoder layers each stage holds, and what the stages send each other.

The split (`stage_layer_ranges`) is vLLM's: contiguous ranges as even as possible, the layers left over
going one each to the stages before the last, counting back from the second-to-last (the first stage
also holds the embedding and the last the final norm and LM head, so both are left lighter).
VLLM_PP_LAYER_PARTITION ("12,10,10") sets the counts by hand, as in vLLM.

Each step (one batch in flight, the stages in turn) a stage receives the hidden states and the residual
stream from the same tensor-parallel rank of the stage before, runs its layers and sends both on; the
last stage's first rank sends the logits of the rows the engine samples (and of prompt-logprob rows) to
global rank 0, which samples as it does without pipeline parallel: the requests' sampling state (seeded
generators, grammars, penalties' token counts) lives there.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from fitserve.distributed.parallel_state import pp
from fitserve.kv_layers import KvLayerSpec

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's decoder layers. ValueError when there are more stages than layers,
    or the partition set by VLLM_PP_LAYER_PARTITION does not cover the layers."""
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} decoder layers: "
            f"set --pipeline-parallel-size {num_layers} or less (every stage holds one layer at least)"
        )
    counts = _counts_from_env(num_layers, num_stages)
    if counts is None:
        counts = [num_layers // num_stages] * num_stages
        for index in range(2, num_layers % num_stages + 2):
            counts[-index] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def _counts_from_env(num_layers: int, num_stages: int) -> list[int] | None:
    value = os.environ.get(PARTITION_ENV)
    if not value:
        return None
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(
            f"{PARTITION_ENV}={value!r} is not a comma-separated list of layer counts: set it to e.g. "
            f"{','.join(['1'] * num_stages)} or unset it"
        ) from None
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"{PARTITION_ENV}={value!r} must give {num_stages} layer counts (one per pipeline stage), each 1 "
            f"or more, adding up to the model's {num_layers} layers: fix it or unset it for an even split"
        )
    return counts


def this_stage_layers(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this process's pipeline stage holds (all without stages)."""
    stage = pp()
    if stage.size == 1:
        return 0, num_layers
    return stage_layer_ranges(num_layers, stage.size)[stage.stage]


def stage_kv_layers(specs: tuple[KvLayerSpec, ...], start: int, end: int) -> tuple[KvLayerSpec, ...]:
    """`specs` with the layers outside [start, end) owning no cache: another stage holds them (their
    entries stay, so caches and groups stay indexed by layer)."""
    return tuple(
        spec if start <= index < end else dataclasses.replace(spec, cache_layer=-1)
        for index, spec in enumerate(specs)
    )


def describe_split(num_layers: int, num_stages: int) -> str:
    """'layers 0-15 on stage 0, 16-31 on stage 1' (what the plan and the startup log say)."""
    parts = [
        f"{start}-{end - 1} on stage {stage}" if end - start > 1 else f"{start} on stage {stage}"
        for stage, (start, end) in enumerate(stage_layer_ranges(num_layers, num_stages))
    ]
    return "layers " + ", ".join(parts)


def send_to_next_stage(tensors: tuple[torch.Tensor, ...]) -> None:
    """Sends each tensor, in order, to the same tensor-parallel rank of the next stage."""
    destination = pp().next_rank
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=destination)


def receive_from_previous_stage(
    count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """`count` tensors of `shape`, in the order the previous stage sent them."""
    source = pp().previous_rank
    received = []
    for _ in range(count):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=source)
        received.append(tensor)
    return tuple(received)


def send_logits_to_first(logits: torch.Tensor, dtype: torch.dtype) -> None:
    """The last stage's first rank: the logits [rows, vocab] to global rank 0, in `dtype`."""
    dist.send(logits.to(dtype).contiguous(), dst=0)


def receive_logits_on_first(
    rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Global rank 0: the logits the last stage's first rank sent (send_logits_to_first)."""
    logits = torch.empty((rows, vocab_size), dtype=dtype, device=device)
    dist.recv(logits, src=pp().last_stage_first_rank)
    return logits
