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


def test_uploads_on_the_copy_stream_wait_for_the_compute_stream_to_read_a_buffer():
    # The compute stream is held up while the host uploads more steps than the ring has buffers: the
    # copy stream runs ahead, and must not overwrite a buffer before the compute stream has read it.
    ring = PinnedStagingRing(torch.device("cuda"), num_buffers=3, initial_bytes=4096)
    ring.upload([np.zeros(8, dtype=np.int64)])  # first use of each buffer: allocation order
    ring.upload([np.zeros(8, dtype=np.int64)])
    ring.upload([np.zeros(8, dtype=np.int64)])
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the compute stream (cycles)
    results = []
    for step in range(9):
        (values,) = ring.upload([np.full(8, step, dtype=np.int64)])
        results.append(values * 1)  # read on the compute stream, behind the sleep
    torch.cuda.synchronize()
    assert [r.tolist() for r in results] == [[step] * 8 for step in range(9)]


def test_sampled_tokens_reach_the_host_while_the_compute_stream_goes_on():
    from fitserve.worker.sampler import PendingSample

    sampled = torch.arange(5, device="cuda") * 3
    torch.cuda._sleep(50_000_000)  # the copy must wait for the compute stream's work before it
    sampled.add_(1)
    pending = PendingSample(sampled, [], None)
    assert pending.result().sampled_token_ids == [1, 4, 7, 10, 13]
