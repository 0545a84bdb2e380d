"""GPU tests share one process per file: what a finished test's engines held (reference cycles keep them
alive until a collection, and PyTorch's allocator keeps freed blocks cached) is given back before the next
test plans its memory, so a test's `gpu_memory_utilization` means the same alone or after others."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _give_back_gpu_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
