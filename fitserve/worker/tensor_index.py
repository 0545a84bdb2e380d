"""Small host lists as device index and value tensors, for the sampler's batched row operations."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fitserve.worker.transfer import tensor_to_device, to_device


def flat_token_index(
    token_lists: list[Iterable[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for every token of every list, as two LongTensors."""
    lengths: list[int] = []
    flat: list[int] = []
    for tokens in token_lists:
        before = len(flat)
        flat.extend(tokens)
        lengths.append(len(flat) - before)
    row_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return tensor_to_device(row_index, device), index_tensor(flat, device)


def row_floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
