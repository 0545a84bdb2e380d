"""State slots of hybrid models: which row of the recurrent state pool (worker/recurrent_state.py) each
running request owns, and the snapshots of that state that let a hybrid take prefix-cache hits. Kept by
the KV cache manager's side of the scheduler.

`StateSlotKVManager` wraps the KV cache manager (the scheduler sees the same interface): a request takes a
slot when it is first given blocks (admission) and gives it back whenever its blocks are freed, which the
scheduler does both when a request finishes and when it is preempted. Preemption is by recompute: the
request comes back with nothing computed (or a prefix-cache hit, below), takes a (maybe different) slot,
and its layers start from zeros (or from the hit's snapshot). The slot is recorded on the request
(`Request.state_slot`, read by worker/step_inputs.py).

Prefix caching (`--mamba-cache-mode`, vLLM's values):

- `align` (the default with prefix caching on, as vLLM picks for Qwen3.5): a KV prefix hit can only skip
  tokens whose recurrent state is known, so the state is snapshotted where a step's computed tokens end
  exactly on a block boundary. The scheduler cuts a prompt chunk that would end inside a block back to the
  last boundary it crosses (`align_chunk`; one reaching the prompt's last token, to the last boundary
  before that token), so a prompt of 2000 tokens is computed as 1984 + 16 and the state after 1984 tokens
  is kept (a prompt of 2048 as 2032 + 16: a hit always leaves a token to compute); decode steps end on a
  boundary every block_size tokens and keep it there too (not a speculative verify step: its state
  after the drafts may not be kept; worker/state_rings.py). A snapshot lives in one of the pool's snapshot
  slots (rows after the live ones), keyed by the chained hash of the block it ends (the KV cache's own
  hash, core/kv_cache.py). `get_computed_blocks` returns the longest KV prefix hit whose last block has a
  snapshot; the request's first step starts its layers from that snapshot (copied into its live slot on
  the device, `StepStateSlots.restores`).
- `none`: no snapshots and no hits: every prompt is computed in full (queries still counted).
- `all` (vLLM: a state at every block boundary, from kernels that emit them) is refused for these models
  at startup (vLLM caches Qwen3.5's Gated DeltaNet in align mode only): `align` keeps what a later
  turn reuses.

Snapshot lifetime: a snapshot is taken (a slot reserved) when its step is scheduled and becomes findable
from the request's next scheduling on (or when it is freed), after the step that writes it was launched:
steps run in order, so a later step that restores it reads it written. A slot whose snapshot a request is
about to restore is pinned until that request is scheduled again. When the snapshot slots are all taken,
the next one goes first to a snapshot whose KV blocks left the prefix cache (unreachable), else to the
least recently used one, where a request's decode snapshot counts as least recently used once the
request keeps a newer one (its prompt's snapshot keeps its place). A step that failed
(`uncache_unwritten`) drops the snapshots it was to write. Hit counters: `prefix_cache_hits` counts only
the tokens a hybrid actually skips.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from fitserve.core.kv_cache import hash_block
from fitserve.core.request import Request
from fitserve.kv_layers import LINEAR

logger = logging.getLogger("fitserve")

STATE_SLOT_ATTR = "state_slot"
# (tokens computed before the step that restores, snapshot slot): set on a request admitted with a hit
STATE_RESTORE_ATTR = "state_restore"
# [(tokens computed at the end of the step that writes it, snapshot slot)]: snapshots not findable yet
STATE_SAVES_ATTR = "state_saves"
# (block boundary, snapshot slot): a speculative verify step's tokens cross this boundary; the snapshot is
# kept if the step's accepted tokens reach it
STATE_VERIFY_SAVE_ATTR = "state_verify_save"
# (block boundary, snapshot slot, tokens computed when it was found accepted): copied from the verify
# step's ring row by the request's next step (worker/state_rings.py), findable after that step
STATE_KEEP_ATTR = "state_keep"
# Slots beyond max_num_seqs: slot 0, which no request gets (worker/recurrent_state.py)
SPARE_STATE_SLOTS = 1
# vLLM's --mamba-cache-mode values
MAMBA_CACHE_MODES = ("none", "align", "all")
DEFAULT_MAMBA_CACHE_MODE = "align"
SNAPSHOTS_PER_SEQ = 2  # see num_snapshot_slots
MAX_SNAPSHOT_SLOTS = 16


def num_ring_rows(max_num_seqs: int, speculative_tokens: int) -> int:
    """State pool rows beyond the live and snapshot slots: under speculative decoding each live slot owns
    a ring of k + 1 rows (worker/state_rings.py), itself and k of these; 0 without speculation."""
    return max_num_seqs * speculative_tokens


def num_state_slots(max_num_seqs: int) -> int:
    return max_num_seqs + SPARE_STATE_SLOTS


def num_snapshot_slots(mamba_cache_mode: str, enable_prefix_caching: bool, max_num_seqs: int) -> int:
    """Snapshot slots after the live ones: SNAPSHOTS_PER_SEQ per running request (max_num_seqs), room for
    each request that can run at once to leave two states: where its prompt's aligned prefill ended (a
    repeat of the prompt, or a sibling sharing it, resumes there) and its latest block boundary in
    decode (its conversation's next turn resumes there); at most MAX_SNAPSHOT_SLOTS, since a slot of a
    large model is large (Qwen3.6-27B: 147 MiB) and a snapshot is of use only while its prefix's KV
    blocks are still cached. None without prefix caching or with --mamba-cache-mode none. The planner
    counts them beside the live slots (planner/kv_memory.py)."""
    if not enable_prefix_caching or mamba_cache_mode != "align":
        return 0
    return min(SNAPSHOTS_PER_SEQ * max(1, max_num_seqs), MAX_SNAPSHOT_SLOTS)


class StateSlots:
    """Free slots 1 .. num_slots - 1 (slot 0 is the pool's spare), handed out lowest first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)


class SnapshotSlots:
    """The snapshot slots first_slot .. first_slot + count - 1: free, reserved for a step's snapshot
    (pending), or holding a findable snapshot keyed by its block hash (LRU order); pins on those a
    request is about to restore."""

    def __init__(self, first_slot: int, count: int) -> None:
        self.first_slot = first_slot
        self.count = count
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._hash_of: dict[int, int] = {}  # slot -> block hash
        self._pins: dict[int, int] = {}  # slot -> requests about to restore it

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, reachable: Any) -> int | None:
        """A slot for a new snapshot: a free one, else the first unpinned snapshot whose blocks are no
        longer cached (`reachable(hash)` False), else the least recently used unpinned one; None when
        every slot is pinned or pending."""
        if self._free:
            return self._free.pop()
        victim = None
        for block_hash, slot in self.by_hash.items():
            if slot in self._pins:
                continue
            if not reachable(block_hash):
                victim = (block_hash, slot)
                break
            if victim is None:
                victim = (block_hash, slot)
        if victim is None:
            return None
        del self.by_hash[victim[0]]
        del self._hash_of[victim[1]]
        return victim[1]

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def publish(self, block_hash: int, slot: int) -> None:
        """The slot holds the state after the block with this hash: findable from now on (an identical
        snapshot already findable is kept and this slot freed)."""
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash)
            self.give_back(slot)
            return
        self.by_hash[block_hash] = slot
        self._hash_of[slot] = block_hash

    def evict_first(self, block_hash: int) -> None:
        """This snapshot goes before any other when a slot is needed (a newer one supersedes it)."""
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash, last=False)

    def lookup(self, block_hash: int) -> int | None:
        slot = self.by_hash.get(block_hash)
        if slot is not None:
            self.by_hash.move_to_end(block_hash)
        return slot

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins.pop(slot, 1) - 1
        if left:
            self._pins[slot] = left

    def drop(self, slot: int) -> None:
        """Forget the snapshot in this slot (its step failed) and free the slot."""
        block_hash = self._hash_of.pop(slot, None)
        if block_hash is not None:
            del self.by_hash[block_hash]
        self.give_back(slot)


class StateSlotKVManager:
    """The KV cache manager of a hybrid model, with a state slot per request and, with prefix caching,
    snapshots of the state at block boundaries (see the module docstring). Everything else is the
    wrapped manager's."""

    def __init__(self, inner: Any, num_slots: int, num_snapshots: int = 0) -> None:
        self._inner = inner
        self.state_slots = StateSlots(num_slots)
        self.snapshots = SnapshotSlots(num_slots, num_snapshots)
        self.block_size: int = inner.block_size
        # --mamba-cache-mode align with prefix caching on: snapshots kept, hits taken
        self.caches_state = bool(getattr(inner, "enable_prefix_caching", False)) and num_snapshots > 0
        self._req_hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._pending_hits: dict[str, tuple[int, int]] = {}  # request id -> (hit blocks, snapshot slot)
        self._pinned: dict[str, int] = {}  # request id -> the snapshot slot its first step restores
        self._requests: dict[str, Request] = {}  # requests holding blocks, by id
        self._latest_decode: dict[str, int] = {}  # request id -> hash of its newest snapshot past its prompt
        if self.caches_state:
            logger.info(
                "Prefix caching: the linear-attention state is snapshotted at block boundaries "
                "(--mamba-cache-mode align, %d snapshot slots); prompt chunks end on block boundaries",
                num_snapshots,
            )
        elif getattr(inner, "enable_prefix_caching", False):
            logger.info(
                "Prefix caching: --mamba-cache-mode none keeps no linear-attention state per block, so this "
                "hybrid model takes no prefix-cache hits (every prompt is computed in full)"
            )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # ---- prefix-cache hits ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Any], int]:
        inner = self._inner
        if not self.caches_state:
            if inner.enable_prefix_caching and not request.needs_prompt_logprobs:
                inner.prefix_cache_queries += request.num_tokens
            return [], 0
        blocks, _ = inner.get_computed_blocks(request)  # counts the query and its KV hits
        num_blocks = len(blocks)
        hashes = self._hashes(request, num_blocks * self.block_size)
        while num_blocks and hashes[num_blocks - 1] not in self.snapshots.by_hash:
            num_blocks -= 1  # the state after these blocks is not kept: the hit ends earlier
        inner.prefix_cache_hits -= (len(blocks) - num_blocks) * self.block_size
        if not num_blocks:
            return [], 0
        slot = self.snapshots.lookup(hashes[num_blocks - 1])
        assert slot is not None
        self._pending_hits[request.request_id] = (num_blocks, slot)
        return blocks[:num_blocks], num_blocks * self.block_size

    def align_chunk(self, request: Request, start: int, num_new: int) -> int:
        """The tokens a step computes from `start`, cut back to end on the last block boundary it crosses
        (scheduler hook; align mode only): where a step ends on a boundary, its state is snapshotted. A
        chunk reaching the request's last known token ends at the last boundary before that token, the
        deepest a later hit can reach (a hit always leaves one token to compute)."""
        if not self.caches_state or num_new <= 1:
            return num_new
        end = start + num_new
        aligned = min(end, request.num_tokens - 1) // self.block_size * self.block_size
        return aligned - start if start < aligned < end else num_new

    # ---- slots ---------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> bool:
        self._settle(request)
        taken = None
        if getattr(request, STATE_SLOT_ATTR, None) is None:
            taken = self.state_slots.take()
            if taken is None:
                return False  # every slot is held: the scheduler admits it later
        if not self._inner.allocate_slots(request, num_new_tokens, *args, **kwargs):
            if taken is not None:
                self.state_slots.give_back(taken)
            return False
        if taken is not None:
            setattr(request, STATE_SLOT_ATTR, taken)
        request_id = request.request_id
        self._requests[request_id] = request
        computed_blocks = args[0] if args else kwargs.get("computed_blocks", ())
        hit = self._pending_hits.pop(request_id, None)
        if computed_blocks and hit is not None:
            num_blocks, slot = hit
            assert num_blocks * self.block_size == request.num_computed_tokens
            self.snapshots.pin(slot)
            self._pinned[request_id] = slot
            setattr(request, STATE_RESTORE_ATTR, (request.num_computed_tokens, slot))
        end = request.num_computed_tokens + num_new_tokens
        # a verify step's drafts (end past the known tokens) are not known to be kept: its boundary's
        # snapshot is reserved now and kept only if the accepted tokens reach it (`_settle`)
        verifies = end > request.num_tokens_with_placeholders
        boundary = end // self.block_size * self.block_size
        if self.caches_state and verifies and boundary > request.num_computed_tokens:
            slot = self.snapshots.take(self._reachable)
            if slot is not None:
                setattr(request, STATE_VERIFY_SAVE_ATTR, (boundary, slot))
        if self.caches_state and end % self.block_size == 0 and not verifies:
            slot = self.snapshots.take(self._reachable)
            if slot is not None:
                saves = getattr(request, STATE_SAVES_ATTR, None) or []
                saves.append((end, slot))
                setattr(request, STATE_SAVES_ATTR, saves)
        return True

    def free(self, request: Request) -> None:
        self._settle(request)
        for _, slot in getattr(request, STATE_SAVES_ATTR, None) or ():
            self.snapshots.give_back(slot)  # its tokens never became known (a step past a stop)
        setattr(request, STATE_SAVES_ATTR, None)
        self._drop_verify_snapshots(request)
        setattr(request, STATE_RESTORE_ATTR, None)
        request_id = request.request_id
        self._pending_hits.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._latest_decode.pop(request_id, None)
        self._inner.free(request)
        self._req_hashes.pop(request_id, None)
        slot = getattr(request, STATE_SLOT_ATTR, None)
        if slot is not None:
            self.state_slots.give_back(slot)
            setattr(request, STATE_SLOT_ATTR, None)

    def uncache_unwritten(self, request_id: str, first_block: int) -> list[int]:
        """The wrapped manager's, and the request's snapshots past first_block are dropped: the step that
        was to write them did not run."""
        request = self._requests.get(request_id)
        saves = getattr(request, STATE_SAVES_ATTR, None) if request is not None else None
        if saves:
            kept = []
            for end, slot in saves:
                if end > first_block * self.block_size:
                    self.snapshots.give_back(slot)
                else:
                    kept.append((end, slot))
            setattr(request, STATE_SAVES_ATTR, kept)
        if request is not None:
            self._drop_verify_snapshots(request)  # a verify step's, or the copy the failed step was to make
        return self._inner.uncache_unwritten(request_id, first_block)

    def _drop_verify_snapshots(self, request: Request) -> None:
        for attr in (STATE_VERIFY_SAVE_ATTR, STATE_KEEP_ATTR):
            entry = getattr(request, attr, None)
            if entry is not None:
                self.snapshots.give_back(entry[1])
                setattr(request, attr, None)

    def _settle(self, request: Request) -> None:
        """At a request's next scheduling (or its end): the steps scheduled before have been launched, so
        its snapshots whose tokens are known become findable, and the snapshot it restored is unpinned."""
        slot = self._pinned.pop(request.request_id, None)
        if slot is not None:
            self.snapshots.unpin(slot)
        self._settle_verify(request)
        saves = getattr(request, STATE_SAVES_ATTR, None)
        if not saves:
            return
        done = min(request.num_computed_tokens, request.num_tokens)
        kept = []
        for end, slot in saves:
            if end > done:
                kept.append((end, slot))
                continue
            self._publish(request, end, slot)
        setattr(request, STATE_SAVES_ATTR, kept)

    def _settle_verify(self, request: Request) -> None:
        """A verify step's boundary snapshot: given back if the accepted tokens stop short of it, else
        copied by the request's step scheduled now (worker/state_rings.py) and findable from the
        scheduling after it (once the request has computed more)."""
        keep = getattr(request, STATE_KEEP_ATTR, None)
        if keep is not None and request.num_computed_tokens > keep[2]:  # the copying step was launched
            setattr(request, STATE_KEEP_ATTR, None)
            self._publish(request, keep[0], keep[1])
        pending = getattr(request, STATE_VERIFY_SAVE_ATTR, None)
        if pending is None:
            return
        setattr(request, STATE_VERIFY_SAVE_ATTR, None)
        boundary, slot = pending
        if boundary > request.num_computed_tokens:
            self.snapshots.give_back(slot)
            return
        older = getattr(request, STATE_KEEP_ATTR, None)
        if older is not None:  # not copied yet (never: a pending save follows the copying step)
            self.snapshots.give_back(older[1])
        setattr(request, STATE_KEEP_ATTR, (boundary, slot, request.num_computed_tokens))

    def _publish(self, request: Request, end: int, slot: int) -> None:
        """The snapshot in `slot` (the state after the request's first `end` tokens) becomes findable."""
        block_hash = self._hashes(request, end)[end // self.block_size - 1]
        self.snapshots.publish(block_hash, slot)
        if end > request.num_prompt_tokens:  # a decode boundary: the one before is superseded
            older = self._latest_decode.get(request.request_id)
            if older is not None and older != block_hash:
                self.snapshots.evict_first(older)
            self._latest_decode[request.request_id] = block_hash

    def _hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's full blocks among its first num_tokens tokens: the KV cache's
        (core/kv_cache.py hash_block), extended lazily."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        while (len(hashes) + 1) * size <= num_tokens:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * size : (i + 1) * size]))
        return hashes

    def _reachable(self, block_hash: int) -> bool:
        pool = getattr(self._inner, "pool", None)
        return pool is None or pool.lookup(block_hash) is not None


class StepStateSlots(list):
    """The scheduled requests' live slots in step order, and the snapshot copies the step makes on the
    device: `restores` row -> the snapshot slot the row's sequence starts from (copied into its slot before
    the step's forward), `saves` row -> the snapshot slot that receives the row's state after it. The
    copies are uploaded with the step's inputs (worker/step_inputs.py) and made for every DeltaNet layer at
    once around the forward (ModelRunner._forward -> the model's copy_states), outside any CUDA graph."""

    def __init__(self, slots: list[int]) -> None:
        super().__init__(slots)
        self.restores: dict[int, int] = {}
        self.saves: dict[int, int] = {}
        # (pool row, snapshot slot): a verify step's accepted boundary state, copied before the forward
        # with the restores (worker/state_rings.py fills it)
        self.keeps: list[tuple[int, int]] = []


def with_state_slots(kv_manager: Any, model_config: Any, max_num_seqs: int) -> Any:
    """kv_manager as the scheduler uses it: wrapped for a hybrid model (one whose layers keep recurrent
    state, worker/recurrent_state.py), itself otherwise. model_config: the engine's ModelConfig (its
    mamba_cache_mode)."""
    if not any(spec.layer_type == LINEAR for spec in model_config.kv_layers):
        return kv_manager
    mode = getattr(model_config, "mamba_cache_mode", DEFAULT_MAMBA_CACHE_MODE)
    caching = bool(getattr(kv_manager, "enable_prefix_caching", False))
    snapshots = num_snapshot_slots(mode, caching, max_num_seqs)
    return StateSlotKVManager(kv_manager, num_state_slots(max_num_seqs), snapshots)


def state_slots_of(scheduled: list[Any]) -> StepStateSlots | None:
    """The scheduled requests' state slots in step order, with the step's snapshot restores and saves
    (worker/step_inputs.py), or None for a model without recurrent state (its requests hold none)."""
    if not scheduled or getattr(scheduled[0].request, STATE_SLOT_ATTR, None) is None:
        return None
    out = StepStateSlots([item.request.state_slot for item in scheduled])
    for row, item in enumerate(scheduled):
        request = item.request
        restore = getattr(request, STATE_RESTORE_ATTR, None)
        if restore is not None and restore[0] == item.start:
            out.restores[row] = restore[1]
        end = item.start + item.num_new_tokens
        for save_end, slot in getattr(request, STATE_SAVES_ATTR, None) or ():
            if save_end == end:
                out.saves[row] = slot
    return out
