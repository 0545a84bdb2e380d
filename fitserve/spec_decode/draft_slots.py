"""The request side of a drafter that keeps its own paged KV cache (draft_model's DraftModel, and through it
EAGLE-3's and MTP's drafters): each request's draft state, its slots in the drafter's pool, and the one
propose loop they share. Device-free: the forwards are the drafter's own (`_draft`).

Per draft, for each decoding request in order: its room (at most k drafts, no more than max_tokens and
max_model_len let the scheduler verify), its draft state (`_sequence`: the drafter's view of the request,
its computed length set back to what the request's tokens confirm), slots for what it will compute
(`_slots_needed`: the catch-up and the drafts fed back, which differ between drafters); a request the
pool cannot hold now gives its state back and drafts later. Then one `_draft` for all of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitserve.config import EngineConfig
    from fitserve.core.kv_cache import KVCacheManager
    from fitserve.core.request import Request


@dataclass
class DraftSequence:
    """The drafter's view of one request: what build_host_inputs and the KV manager read of a request."""

    request_id: str
    all_token_ids: list[int]  # the request's own list (read, never written)
    num_prompt_tokens: int
    num_preemptions: int
    num_computed_tokens: int = 0  # tokens whose keys and values the drafter holds
    # drafts whose keys and values were written after the known tokens at the last draft (checked
    # against the request's tokens at the next one) and where they start
    drafted: tuple[int, ...] = ()
    drafted_at: int = 0
    needs_prompt_logprobs: bool = False


class DraftSlots(ABC):
    """Each request's draft state and slots; the subclass sets these attributes up and gives the hooks
    `_sequence`, `_slots_needed` and `_draft`."""

    config: EngineConfig
    k: int  # drafts per request at most
    kv_manager: KVCacheManager | None  # the drafter's pool (None before allocate_kv_cache)
    table_rows: Any  # the drafter's block table rows (worker/block_table_rows.py): `release(request_id)`
    sequences: dict[str, DraftSequence]

    def propose(self, requests: list[Request], running_ids: set[str]) -> list[list[int]]:
        """Up to k greedy drafts for each of `requests` (decoding requests, each with no token in
        flight), in order; [] for one that gets none (no room left before max_tokens or max_model_len,
        or no free draft blocks). `running_ids`: the running requests; the draft state of any other is
        freed (finished, or preempted: recomputed when it decodes again)."""
        for request_id in [r for r in self.sequences if r not in running_ids]:
            self._free(request_id)
        wanted: list[tuple[DraftSequence, int]] = []
        for request in requests:
            count = self._room(request)
            if count <= 0:
                continue
            seq = self._sequence(request)
            if not self._allocate(seq, self._slots_needed(request, seq, count)):
                continue
            wanted.append((seq, count))
        drafts: dict[str, list[int]] = {}
        if wanted:
            drafts = self._draft(wanted)
        return [drafts.get(r.request_id, []) for r in requests]

    def release(self, request_ids: Iterable[str]) -> None:
        """Gives back the draft state of these requests (finished)."""
        for request_id in request_ids:
            self._free(request_id)

    def _free(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.kv_manager.free(seq)  # nothing to give back for one that never drafted
            self.table_rows.release(request_id)

    def _allocate(self, seq: DraftSequence, need: int) -> bool:
        """Slots for `need` more tokens after the computed ones; when the pool is short the request's
        state is given back (it starts over later) and False returned."""
        if not self.kv_manager.allocate_slots(seq, max(need, 0)):
            self._free(seq.request_id)
            return False
        return True

    def _room(self, request: Request) -> int:
        """Drafts worth computing: at most k, and no more than the scheduler could verify (max_tokens,
        max_model_len)."""
        room = min(self.k, self.config.model.max_model_len - request.num_tokens - 1)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return room

    # ---- the drafter's hooks -------------------------------------------------------------------------
    @abstractmethod
    def _sequence(self, request: Request) -> DraftSequence:
        """The request's draft state, its computed length set back to what the request's tokens confirm."""

    @abstractmethod
    def _slots_needed(self, request: Request, seq: DraftSequence, count: int) -> int:
        """The slots `seq` needs after its computed tokens to draft `count` tokens."""

    @abstractmethod
    def _draft(self, wanted: list[tuple[DraftSequence, int]]) -> dict[str, list[int]]:
        """The drafts of each (sequence, how many to draft), by request id; slots already allocated."""
