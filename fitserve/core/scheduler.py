"""One token-budget loop: every step moves each request's num_computed_tokens toward num_tokens.

There are no prefill and decode phases. A running request asks for its missing tokens (one for a
decoding request, a chunk of its prompt otherwise); waiting requests are admitted in arrival order
while the step's token budget, max_num_seqs and the block pool allow. With a long-prefill threshold,
no request takes more than that many tokens in one step, so a lone prompt arriving beside running
streams is spread over several steps while several prompts still fill a step between them. When the
pool runs dry, the most recently admitted running request is preempted: its blocks are freed and it is
recomputed later (its computed blocks usually come back as prefix-cache hits).

Asynchronous scheduling: the engine may schedule step N+1 before step N's sampled tokens reached the
host. A request sampled by a step in flight counts that token as a placeholder
(Request.num_output_placeholders): it is scheduled as if the token were known (the model runner takes
it from the device), and it is not scheduled past max_tokens or max_model_len counting placeholders.
A request that turns out to have stopped (eos, a stop string) computes one token more, which is dropped.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from fitserve.config import SchedulerConfig
from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.kv_cache_groups import HybridKVCacheManager
from fitserve.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step: position of the first new token
    num_new_tokens: int
    block_ids: list[int]
    # True when this step computes the request's last token (known or placeholder): a new one is sampled.
    samples: bool
    # The tables of KV cache groups 1.. (sliding-window layers: null before the window), for a model that
    # has several groups (core/kv_cache_groups.py); () with one group, whose table is block_ids.
    group_block_ids: tuple[list[int], ...] = ()
    # Speculative decoding: the draft tokens this step verifies after the request's last known token
    # (num_new_tokens is then 1 + their count; fitserve/spec_decode/verify.py).
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """The one contract between the scheduler and the model runner."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # since the last step: drop their state
    num_preempted: int = 0
    # requests the KV cache cannot hold even alone (a pool smaller than one request, as
    # --num-gpu-blocks-override allows): preempted and waiting, for the engine to end with an error
    unservable: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager | HybridKVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self._several_groups = kv_manager.num_groups > 1
        # hybrid models: prompt chunks end on block boundaries, where the state is kept (core/state_slots.py)
        self._align_chunk = getattr(kv_manager, "align_chunk", None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions_total = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        unservable: list[Request] = []

        # The loop below runs for every running request every step: its lookups are hoisted, and a
        # decoding request (one token missing) skips the chunking arithmetic.
        running = self.running
        align_chunk = self._align_chunk
        allocate_slots = self.kv_manager.allocate_slots
        threshold = self.config.long_prefill_token_threshold
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            missing = len(request.all_token_ids) + request.num_output_placeholders - computed
            if missing == 1 and align_chunk is None:
                num_new = 1
            else:
                num_new = self._chunk(missing, budget) if threshold or missing > budget else missing
                if align_chunk is not None:  # hybrid models (core/state_slots.py)
                    num_new = align_chunk(request, computed, num_new)
            if num_new <= 0 or (request.num_output_placeholders and self._reaches_limit(request)):
                i += 1
                continue
            drafts = self._drafts(request, num_new, budget) if request.spec_token_ids else ()
            num_new += len(drafts)
            while not allocate_slots(request, num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    if not running:  # no other request holds a block: it never fits
                        unservable.append(request)
                    break
            else:
                scheduled.append(self._record(request, num_new, drafts))
                budget -= num_new
                i += 1

        if not preempted:
            budget = self._admit_waiting(scheduled, budget, unservable)

        finished = self._finished_since_last_step
        self._finished_since_last_step = set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            num_preempted=len(preempted),
            unservable=unservable,
        )

    def _admit_waiting(
        self, scheduled: list[ScheduledRequest], budget: int, unservable: list[Request]
    ) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._gated_on_sibling(request):
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit_tokens = self.kv_manager.get_computed_blocks(request)
            num_new = self._chunk(request.num_tokens - num_hit_tokens, budget)
            if self._align_chunk is not None:  # hybrid models (core/state_slots.py)
                num_new = self._align_chunk(request, num_hit_tokens, num_new)
            request.num_computed_tokens = num_hit_tokens
            if not self.kv_manager.allocate_slots(request, num_new, computed_blocks):
                request.num_computed_tokens = 0
                if not self.running and not scheduled:  # the whole pool is free and still too small
                    unservable.append(request)
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._record(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _chunk(self, missing: int, budget: int) -> int:
        """Tokens a request computes this step: what it misses, at most the long-prefill threshold (when
        set) and the step's remaining budget."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < missing:
            missing = threshold
        return min(missing, budget)

    def _drafts(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The draft tokens this step verifies for a decoding request (taken from it: drafts are proposed
        afresh before each step), cut so that what they could add stays within max_tokens,
        max_model_len and the step's budget."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or num_new != 1 or request.num_output_placeholders:
            return ()
        room = min(budget - 1, self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return tuple(drafts[: max(room, 0)])

    def _reaches_limit(self, request: Request) -> bool:
        """True when the tokens in flight already end the request (max_tokens or max_model_len): it
        finishes when they arrive, so computing another would be wasted."""
        placeholders = request.num_output_placeholders
        if not placeholders:
            return False
        max_tokens = request.params.max_tokens
        if max_tokens is not None and len(request.output_token_ids) + placeholders >= max_tokens:
            return True
        return len(request.all_token_ids) + placeholders >= self.config.max_model_len

    def _gated_on_sibling(self, request: Request) -> bool:
        first = request.waits_for
        if first is None:
            return False
        if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
            request.waits_for = None
            return False
        return True

    def _record(self, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        computed = request.num_computed_tokens = start + num_new
        # drafts are computed past the known tokens (rolled back to the accepted ones afterwards)
        samples = computed >= len(request.all_token_ids) + request.num_output_placeholders
        if samples:
            request.num_output_placeholders += 1
        block_ids = self.kv_manager.block_ids(request.request_id)
        groups = ()
        if self._several_groups:
            groups = self.kv_manager.group_block_ids(request.request_id)  # type: ignore[union-attr]
        return ScheduledRequest(request, start, num_new, block_ids, samples, groups, drafts)

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append sampled tokens, finish requests that hit eos / a stop token / a length limit.

        Returns the requests that received a token this step (finished ones included). A request that
        verified drafts gets its first token here, the rest through append_tokens.
        """
        progressed = []
        running = RequestStatus.RUNNING
        for item in output.scheduled:
            if not item.samples:
                continue
            request = item.request
            request.num_output_placeholders -= 1
            if item.draft_token_ids:
                # the drafts' keys and values beyond the accepted ones are written over later
                request.num_computed_tokens = item.start + 1
            token_id = sampled.get(request.request_id)
            if token_id is None or (request.status is not running and request.is_finished):
                continue
            self._append(request, token_id)
            progressed.append(request)
        return progressed

    def append_tokens(self, tokens: dict[str, int]) -> list[Request]:
        """One more token for each of these requests (an accepted draft's position of a verify step, in
        order), unless it already finished; returns those that took one."""
        progressed = []
        for request_id, token_id in tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            request.num_computed_tokens += 1  # the accepted draft's keys and values are in the cache
            self._append(request, token_id)
            progressed.append(request)
        return progressed

    def _append(self, request: Request, token_id: int) -> None:
        request.append_output_token(token_id)
        status = self._check_stop(request, token_id)
        if status is not None:
            self._finish(request, status)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        num_outputs = len(request.output_token_ids)
        if num_outputs >= params.min_tokens:
            if token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if max_tokens is not None and num_outputs >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self.kv_manager.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_since_last_step.add(request.request_id)
