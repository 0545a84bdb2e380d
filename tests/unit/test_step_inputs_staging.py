"""The host-side helpers that build a step's inputs: block-table rows kept across steps, the upload."""

from __future__ import annotations

import numpy as np
import torch

from fitserve.worker.block_table_rows import BlockTableRows
from fitserve.worker.transfer import PinnedStagingRing


def test_a_row_follows_its_growing_block_list():
    rows = BlockTableRows(max_blocks_per_seq=8, initial_rows=2)
    blocks = [3, 4]
    row = rows.row("a", blocks)
    blocks.append(9)  # the live list grew by one block
    assert rows.row("a", blocks) == row
    assert rows.gather([row], 3).tolist() == [[3, 4, 9]]


def test_a_replaced_block_list_is_copied_again():
    rows = BlockTableRows(max_blocks_per_seq=8)
    row = rows.row("a", [3, 4, 5])
    again = rows.row("a", [7])  # preempted, admitted again: a new list
    assert again == row and rows.gather([row], 1).tolist() == [[7]]


def test_released_rows_are_reused_and_the_table_grows():
    rows = BlockTableRows(max_blocks_per_seq=4, initial_rows=2)
    first = rows.row("a", [1])
    rows.row("b", [2])
    third = rows.row("c", [3])  # a third request: the table doubles
    assert rows.table.shape[0] == 4 and third not in (first,)
    rows.release("a")
    assert rows.row("d", [5]) == first
    assert rows.gather([first, third], 1).tolist() == [[5], [3]]


def test_the_staging_ring_keeps_dtypes_shapes_and_values():
    ring = PinnedStagingRing(torch.device("cpu"))
    arrays = [np.arange(5, dtype=np.int64), np.ones((2, 3), dtype=np.int32), np.array([], dtype=np.int64)]
    out = ring.upload(arrays)
    assert [t.dtype for t in out] == [torch.int64, torch.int32, torch.int64]
    assert [tuple(t.shape) for t in out] == [(5,), (2, 3), (0,)]
    assert out[0].tolist() == [0, 1, 2, 3, 4] and out[1].sum().item() == 6
