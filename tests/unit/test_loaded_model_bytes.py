"""The "Model loading took X GiB" figure: every storage once, plus the CPU layers' packed copies."""

from __future__ import annotations

import torch
from torch import nn

from fitserve.worker.model_runner import loaded_model_bytes


def test_counts_shared_storage_once_and_adds_packed_copies() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(100, 8)
    model.head = nn.Linear(8, 100, bias=False)
    model.head.weight = model.embed.weight  # tied: one storage
    model.proj = nn.Linear(8, 8)
    model.proj.register_buffer("table", torch.zeros(10, dtype=torch.float64))
    expected = (100 * 8 + 8 * 8 + 8) * 4 + 10 * 8
    assert loaded_model_bytes(model) == expected
    model.proj.packed_copy_bytes = 8 * 8 * 2  # a float16 copy held outside parameters
    assert loaded_model_bytes(model) == expected + 128


def test_views_of_one_buffer_count_the_buffer_once() -> None:
    buffer = torch.zeros(1000)
    model = nn.Module()
    model.a = nn.Parameter(buffer[:10], requires_grad=False)
    model.b = nn.Parameter(buffer[10:30], requires_grad=False)
    assert loaded_model_bytes(model) == 1000 * 4
