"""Speculative decoding on hybrid models: the recurrent state rolled back to the accepted tokens.

A verify step computes a request's last known token and its m drafts (m <= k) as m + 1 consecutive
tokens of one sequence (spec_decode/verify.py). A DeltaNet layer runs them in order, and the state after
each of them is kept, because which one the request continues from is known only once the step's samples
are compared with the drafts. So each live state slot (core/state_slots.py) owns a ring of k + 1 pool
rows: position 0 is the slot itself, positions 1..k are rows after the live and snapshot slots
(worker/recurrent_state.py). The request's state is at one position c of its ring. Its verify step reads
row c and writes the state after its token j into position (c + 1 + j) mod (k + 1) (the last, j = k,
lands on c itself, already read); when the step keeps n tokens (the last known one and the n - 1 accepted
drafts), the state is at position (c + n) mod (k + 1): no copy, nothing recomputed. A step without drafts
updates position c in place, as without speculation.

The position of each ring is bookkept here, on the first rank (its requests are the scheduler's): a verify
step leaves on its request where its chain started (`VERIFY_CHAIN_ATTR`), and the request's next step
resolves it from how many tokens the scheduler kept (its `start`). A request that was preempted or
finished meanwhile starts its next sequence from zeros or a restored snapshot, which any position holds
as well. The other tensor-parallel ranks receive the pool rows with the step's inputs.

Prefix caching (align mode): a verify step that crosses a block boundary has its snapshot slot reserved
by the scheduler; if the accepted tokens reach the boundary, the request's next step copies the state
there from its ring row into the snapshot before its forward (`StepStateSlots.keeps`, with the restores),
and the scheduler makes it findable after that step (core/state_slots.py). A snapshot holds the state of
accepted tokens only.

What the DeltaNet layers read (`StepChain`, models/delta_net_chain.py): each decode row's pool row (the
state after its token), and per decode row the row it continues from (row c, or the row of token j - 1)
and, where a chain starts, its length: the Triton kernels run each chain in one program. The torch path
runs the decode rows by depth instead (depth j: every chain's row j, and the plain decode rows at depth
0), each depth's rows first copying the state they continue from into their own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fitserve.core.state_slots import (
    SPARE_STATE_SLOTS,
    STATE_KEEP_ATTR,
    STATE_SLOT_ATTR,
    StepStateSlots,
    num_snapshot_slots,
)
from fitserve.kv_layers import LINEAR

# (first position of the chain, its rows' count, the ring position it read, its live slot): set on a
# request by the verify step that computed its drafts, resolved by its next step
VERIFY_CHAIN_ATTR = "state_verify_chain"


@dataclass
class ChainDepth:
    """One depth of a step's decode rows, on the host: the decode rows (their index among the step's
    decode rows) computed at this depth, each one's pool row, and the copies made first (source rows,
    target rows: a verify row's state continued from another row)."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    copy_sources: list[int] = field(default_factory=list)
    copy_targets: list[int] = field(default_factory=list)

    def add(self, row: int, slot: int, source: int | None = None) -> None:
        self.rows.append(row)
        self.slots.append(slot)
        if source is not None and source != slot:
            self.copy_sources.append(source)
            self.copy_targets.append(slot)

    def array(self) -> np.ndarray:
        """[rows | slots | copy sources | copy targets] as one int64 array (sizes: `sizes`)."""
        return np.array(self.rows + self.slots + self.copy_sources + self.copy_targets, dtype=np.int64)

    @property
    def sizes(self) -> tuple[int, int]:
        return len(self.rows), len(self.copy_sources)


@dataclass
class StepChain:
    """A verify step's decode rows, on the host: by depth (the torch path runs them depth by depth), and
    per decode row the row its state continues from and its chain's length if it starts one (0 for a
    later row of a chain; the Triton path runs each chain in one program)."""

    depths: list[ChainDepth] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def arrays(self) -> list[np.ndarray]:
        """Each depth's array, then [sources | lengths] (int64), in upload order."""
        heads = np.array(self.sources + self.lengths, dtype=np.int64)
        return [*(depth.array() for depth in self.depths), heads]

    @property
    def sizes(self) -> list[tuple[int, int]]:
        return [depth.sizes for depth in self.depths]


class StateRings:
    """The ring position of each live slot, and the step's pool rows under speculation."""

    def __init__(self, max_num_seqs: int, num_snapshots: int, speculative_tokens: int) -> None:
        self.k = speculative_tokens
        self.first_extra_row = max_num_seqs + SPARE_STATE_SLOTS + num_snapshots
        self._position: dict[int, int] = {}  # live slot -> the ring position holding its state

    def row(self, slot: int, position: int) -> int:
        """The pool row of a live slot's ring position."""
        if position == 0:
            return slot
        return self.first_extra_row + (slot - SPARE_STATE_SLOTS) * self.k + position - 1

    def current_row(self, slot: int) -> int:
        return self.row(slot, self._position.get(slot, 0))

    def place(
        self, scheduled: list[Any], slots: StepStateSlots, query_lens: list[int], seq_lens: list[int]
    ) -> tuple[StepStateSlots, StepChain | None]:
        """The step's rows (`scheduled`: after verify_rows) with their live slots turned into pool rows,
        and, when a request verifies drafts, the step's decode rows by chain depth (None without one: the
        step runs as a plain one). Snapshot restores and saves keep their rows (their targets and sources
        are the rows' pool rows)."""
        keeps = [keep for item in scheduled if (keep := self._resolve(item)) is not None]
        rows = StepStateSlots([self.current_row(slot) for slot in slots])
        rows.restores = dict(slots.restores)
        rows.saves = dict(slots.saves)
        rows.keeps = keeps
        depth_of = verify_depths(scheduled)
        if not any(depth is not None for depth in depth_of):
            return rows, None
        chain = StepChain()
        decode_index = -1
        previous_row = 0
        for i, item in enumerate(scheduled):
            if not (query_lens[i] == 1 and seq_lens[i] > 1):
                continue  # a prompt piece (layers/gated_delta_rule.split_state_rows): not in the chain
            decode_index += 1
            depth = depth_of[i]
            if depth is None:  # a plain decode row: its state updated in place
                _depth(chain.depths, 0).add(decode_index, rows[i])
                chain.sources.append(rows[i])
                chain.lengths.append(1)
                continue
            slot = slots[i]
            position = self._position.get(slot, 0)
            target = self.row(slot, (position + 1 + depth) % (self.k + 1))
            source = rows[i] if depth == 0 else previous_row
            _depth(chain.depths, depth).add(decode_index, target, source)
            rows[i] = target
            previous_row = target
            chain_rows = _chain_rows(depth_of, i) if depth == 0 else 0
            chain.sources.append(source)
            chain.lengths.append(chain_rows)
            if depth == 0:
                setattr(item.request, VERIFY_CHAIN_ATTR, (item.start, chain_rows, position, slot))
        return rows, chain

    def _resolve(self, item: Any) -> tuple[int, int] | None:
        """The request's last verify step kept item.start - its start tokens: its ring moves that far.
        Returns the copy (pool row, snapshot slot) of the state at a block boundary those tokens reached,
        when the scheduler keeps it (core/state_slots.py STATE_KEEP_ATTR), else None."""
        request = item.request
        chain = getattr(request, VERIFY_CHAIN_ATTR, None)
        if chain is None:
            return None
        setattr(request, VERIFY_CHAIN_ATTR, None)
        start, chain_rows, position, slot = chain
        kept = item.start - start
        if getattr(request, STATE_SLOT_ATTR, None) != slot or not 1 <= kept <= chain_rows:
            return None  # preempted meanwhile: its next sequence starts afresh
        self._position[slot] = (position + kept) % (self.k + 1)
        keep = getattr(request, STATE_KEEP_ATTR, None)
        if keep is None or not start < keep[0] <= start + kept:
            return None
        # the state after token j of the chain (keep[0] = start + j + 1 tokens) is at position c + 1 + j
        return self.row(slot, (position + keep[0] - start) % (self.k + 1)), keep[1]


def verify_depths(scheduled: list[Any]) -> list[int | None]:
    """Each row's depth in its request's verify chain (row j of spec_decode/verify.py's k + 1 rows: j);
    None for a row that verifies nothing. A request's rows are consecutive, and a request has several
    rows only in a verify step (its first row carries no drafts, the next ones the drafts before them)."""
    depths: list[int | None] = []
    for i, item in enumerate(scheduled):
        follows = i > 0 and scheduled[i - 1].request is item.request
        leads = i + 1 < len(scheduled) and scheduled[i + 1].request is item.request
        depths.append(len(item.draft_token_ids) if follows or leads else None)
    return depths


def _chain_rows(depth_of: list[int | None], first: int) -> int:
    """The rows of the verify chain starting at row `first` (depth 0)."""
    count = 1
    for depth in depth_of[first + 1 :]:
        if depth is None or depth == 0:
            break
        count += 1
    return count


def _depth(depths: list[ChainDepth], index: int) -> ChainDepth:
    while len(depths) <= index:
        depths.append(ChainDepth())
    return depths[index]


def state_rings_for(config: Any) -> StateRings | None:
    """The rings of a hybrid model under speculative decoding (config: the EngineConfig); None otherwise."""
    if config.speculative is None or not any(spec.layer_type == LINEAR for spec in config.model.kv_layers):
        return None
    max_num_seqs = config.scheduler.max_num_seqs
    snapshots = num_snapshot_slots(
        config.model.mamba_cache_mode, config.cache.enable_prefix_caching, max_num_seqs
    )
    return StateRings(max_num_seqs, snapshots, config.speculative.num_speculative_tokens)
