"""The pinned staging ring on the GPU: one copy per step, values intact while later uploads reuse it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fitserve.worker.transfer import PinnedStagingRing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_uploads_arrive_intact_and_buffers_rotate():
    ring = PinnedStagingRing(torch.device("cuda"), num_buffers=3, initial_bytes=64)
    results = []
    for step in range(7):  # more steps than buffers, and a buffer that must grow
        arrays = [
            np.arange(step, step + 50, dtype=np.int64),
            np.full((4, 3), step, dtype=np.int32),
            np.array([step * 0.5], dtype=np.float32),
        ]
        tensors = ring.upload(arrays)
        results.append([t.clone() for t in tensors])  # cloned in stream order, before the reuse
    torch.cuda.synchronize()
    for step, (ids, table, value) in enumerate(results):
        assert ids.tolist() == list(range(step, step + 50))
        assert table.dtype == torch.int32 and table.shape == (4, 3) and (table == step).all()
        assert value.item() == step * 0.5
