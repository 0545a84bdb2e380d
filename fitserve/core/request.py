"""One sequence the scheduler moves forward: its tokens, how many are computed, its status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its step failed (out of device memory); RequestOutput.error says why

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


# A tuple, not a frozenset: `in` compares identities in C, where a set hashes the status through
# Enum.__hash__, a Python function (is_finished runs for every request of every step).
_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)


class Request:
    """A single sequence (one of a parent's n samples).

    Invariants: 0 <= num_computed_tokens <= num_tokens_with_placeholders; every token at an index
    below num_computed_tokens has its keys/values in the blocks listed by the KV cache manager (or
    will have, once the step computing it finishes on the device).
    """

    def __init__(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id
        self.index = index  # position among the parent's n outputs
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight, not yet appended (asynchronous scheduling): the
        # scheduler plans with num_tokens + num_output_placeholders known tokens.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until scheduled
        self.num_preemptions = 0
        self.stop_reason: str | int | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        # Sibling gate: a later sample of an n > 1 request waits until the first sample's prompt is
        # computed, so its prompt blocks come from the prefix cache instead of being computed again.
        self.waits_for: Request | None = None
        # Hybrid models: its row of the recurrent state pool while it holds one (core/state_slots.py)
        self.state_slot: int | None = None
        # Structured outputs: this sequence's grammar state (fitserve/structured), set once its grammar
        # is compiled, before the request reaches the scheduler; None = unconstrained.
        self.grammar: Any = None
        # Speculative decoding: draft tokens to verify after the last known token in the next step
        # (fitserve/spec_decode), set just before that step is scheduled.
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
