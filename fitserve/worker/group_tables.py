"""The step's slot mappings and block tables of KV cache groups 1.. (fitserve/kv_groups.py).

Group 0's come with the step's main inputs (model_runner.py); a model with sliding-window layers has
more groups, each with its own blocks: a sliding group's table holds the null block (0) before the
first block its window reads, and its new tokens' slots are in its own blocks. Every group's metadata
shares the step's query and sequence lengths.
"""

from __future__ import annotations

import numpy as np

from fitserve.core.scheduler import ScheduledRequest
from fitserve.kv_groups import KvCacheGroup
from fitserve.worker.block_table_rows import WindowTableRows, extend_slots


class GroupTables:
    def __init__(self, groups: tuple[KvCacheGroup, ...], max_blocks_per_seq: int, block_size: int) -> None:
        self.groups = groups[1:]
        self.block_size = block_size
        self.rows = [WindowTableRows(max_blocks_per_seq) for _ in self.groups]

    def release(self, request_id: str) -> None:
        for rows in self.rows:
            rows.release(request_id)

    def arrays(self, scheduled: list[ScheduledRequest]) -> list[np.ndarray]:
        """Per group 1..: slot_mapping int64 [T] and block_tables int32 [B, max blocks], in that order."""
        bs = self.block_size
        out: list[np.ndarray] = []
        for index, (group, table_rows) in enumerate(zip(self.groups, self.rows)):
            window = group.sliding_window
            slots: list[int] = []
            rows: list[int] = []
            max_blocks = 0
            for item in scheduled:
                table = item.group_block_ids[index]
                start, n = item.start, item.num_new_tokens
                if n == 1:
                    slots.append(table[start // bs] * bs + start % bs)
                else:
                    extend_slots(slots, table, start, start + n, bs)
                # A verify step's k + 1 rows of a request share one table row: zero it only behind the window
                # of the first (row j has the j drafts before it), or the earlier rows would lose keys
                first = start - len(item.draft_token_ids)
                first_live = 0 if window is None else max(0, first - window + 1) // bs
                rows.append(table_rows.row_in_window(item.request.request_id, table, first_live))
                max_blocks = max(max_blocks, len(table))
            out.append(np.array(slots, dtype=np.int64))
            out.append(table_rows.gather(rows, max_blocks))
        return out
