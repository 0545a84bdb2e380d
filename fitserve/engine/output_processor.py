"""From sampled tokens to RequestOutputs: detokenize, find stop strings, gather a parent's n samples."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import overload

from fitserve.core.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from fitserve.core.request import Request, RequestStatus
from fitserve.core.sampling_params import RequestOutputKind, SamplingParams
from fitserve.engine.detokenizer import IncrementalDetokenizer, decode_token

# A child whose status is one of these has finished (Request.is_finished, without a property call per
# child and step). A tuple, not a set: its `in` compares identities in C, where a set would hash each
# status through Enum.__hash__, a Python function (three calls per request and step).
FINISHED_STATUSES = tuple(status for status in RequestStatus if status.is_finished)


@dataclass
class ParentRequest:
    """What the user submitted: one prompt with n samples (children)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    logprobs: list[list[PositionLogprobs]] = field(default_factory=list)
    cumulative_logprobs: list[float] = field(default_factory=list)
    # Built positions, or (decode_logprob_tokens off) the sampler's entries, converted when read
    prompt_logprobs: list[PositionLogprobs | None] | list[TokenLogprobs | None] | None = None
    error: str | None = None  # why the engine ended it early (its step failed)

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # Fill each logprob entry's `decoded_token` here, on the engine thread. The server turns this off
        # and decodes in its request handlers: an echoed 8,000-token prompt with 20 logprobs holds 168,000
        # entries, and every stream waits while the engine thread works (benchmarks/prompt_logprobs.py).
        self.decode_logprob_tokens = True
        self._token_texts: dict[int, str] = {}  # token id -> its text; at most one entry per vocabulary id
        # True where every output is read at once, before the next step (the engine process encodes them
        # into deltas, output_deltas.py): a choice's token ids and logprobs are then the request's own
        # lists, not copies (copying each request's whole output every step is O(length) per token).
        # False (the engine thread, LLM): each output keeps lists of its own.
        self.share_token_lists = False
        self._unscheduled: set[str] = set()  # children not scheduled yet (for first_scheduled_time)
        self.parents: dict[str, ParentRequest] = {}
        self.child_to_parent: dict[str, ParentRequest] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        parent.logprobs = [[] for _ in parent.children]
        parent.cumulative_logprobs = [0.0 for _ in parent.children]
        parent.metrics.max_tokens_param = parent.params.max_tokens
        if parent.params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for child in parent.children:
            self.child_to_parent[child.request_id] = parent
            self._unscheduled.add(child.request_id)

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request_id for c in parent.children] if parent else []

    def mark_scheduled(self, child_ids: Iterable[str], now: float) -> None:
        """Sets first_scheduled_time of the parents of these children that had none; nothing to look at
        (every step of a busy server) once each child has been scheduled."""
        unscheduled = self._unscheduled
        if not unscheduled:
            return
        for child_id in unscheduled.intersection(child_ids):
            unscheduled.discard(child_id)
            parent = self.child_to_parent.get(child_id)
            if parent is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now

    def add_prompt_logprobs(self, chunks: dict[str, list[TokenLogprobs]]) -> None:
        for child_id, entries in chunks.items():
            parent = self.child_to_parent.get(child_id)
            if parent is None or parent.children[0].request_id != child_id or parent.prompt_logprobs is None:
                continue
            if self.decode_logprob_tokens:
                parent.prompt_logprobs.extend(self._position_logprobs(e) for e in entries)
            else:  # kept as the sampler made them: LazyPromptLogprobs builds the positions when read
                parent.prompt_logprobs.extend(entries)

    def apply_tokens(
        self, progressed: list[Request], token_logprobs: dict[str, TokenLogprobs], now: float
    ) -> list[tuple[Request, str]]:
        """Feed each new token to its detokenizer; returns the children a stop string just ended."""
        stopped: list[tuple[Request, str]] = []
        child_to_parent = self.child_to_parent
        stopped_status = RequestStatus.FINISHED_STOPPED
        for child in progressed:
            parent = child_to_parent.get(child.request_id)
            if parent is None:  # aborted after its token was sampled
                continue
            metrics = parent.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if token_logprobs:
                entry = token_logprobs.get(child.request_id)
                if entry is not None:
                    parent.logprobs[child.index].append(self._position_logprobs(entry))
                    parent.cumulative_logprobs[child.index] += entry.logprobs[0]
            detokenizer = parent.detokenizers[child.index]
            if detokenizer is None:
                continue
            status = child.status
            if status is stopped_status and not parent.params.include_stop_str_in_output:
                # ended by an EOS / stop token (the scheduler finished it with "stop" as it was sampled;
                # stop strings end a child only after its text is built): the token's own text is left
                # out, as vLLM does
                stop = None
            else:
                stop = detokenizer.add_tokens([child.output_token_ids[-1]])
            finished = status in FINISHED_STATUSES
            if stop is None and finished:
                detokenizer.finish()  # flush a trailing partial character as decode() would
            if stop is not None and not finished:
                stopped.append((child, stop))
        return stopped

    def make_outputs(self, parent_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        now = time.time()
        parents = self.parents
        final_only = RequestOutputKind.FINAL_ONLY
        for parent_id in parent_ids:
            parent = parents.get(parent_id)
            if parent is None:
                continue
            children = parent.children
            if len(children) == 1:  # the common case, without a generator per output
                finished = children[0].status in FINISHED_STATUSES
            else:
                finished = all(child.status in FINISHED_STATUSES for child in children)
            if not finished and parent.params.output_kind is final_only:
                continue
            if finished:
                parent.metrics.finished_time = now
                self._forget(parent)
            outputs.append(self._request_output(parent, finished))
        return outputs

    def fail(self, parent_id: str, message: str) -> None:
        """Records why a request was ended with an error; its next output carries the message."""
        parent = self.parents.get(parent_id)
        if parent is not None:
            parent.error = message

    def abort(self, parent_id: str) -> None:
        parent = self.parents.get(parent_id)
        if parent is not None:
            self._forget(parent)

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_to_parent.pop(child.request_id, None)
            self._unscheduled.discard(child.request_id)

    def _request_output(self, parent: ParentRequest, finished: bool) -> RequestOutput:
        completions = []
        want_logprobs = parent.params.logprobs is not None
        shared = self.share_token_lists
        for child, detokenizer in zip(parent.children, parent.detokenizers):
            child_finished = child.status in FINISHED_STATUSES
            text = ""
            if detokenizer is not None:
                text = detokenizer.output_text if child_finished else detokenizer.stream_text(False)
            index = child.index
            logprobs = None
            if want_logprobs:
                logprobs = parent.logprobs[index] if shared else parent.logprobs[index].copy()
            completions.append(
                CompletionOutput(
                    index,
                    text,
                    child.output_token_ids if shared else child.output_token_ids.copy(),
                    parent.cumulative_logprobs[index] if want_logprobs else None,
                    logprobs,
                    child.status.value if child_finished else None,
                    child.stop_reason,
                )
            )
        num_cached_tokens = parent.children[0].num_cached_tokens
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            finished,
            None if parent.prompt_logprobs is None else self._prompt_logprobs(parent),
            parent.metrics,
            num_cached_tokens if num_cached_tokens > 0 else 0,
            {},
            parent.error if finished else None,
        )

    def _prompt_logprobs(self, parent: ParentRequest) -> Sequence[PositionLogprobs | None] | None:
        if parent.prompt_logprobs is None:
            return None
        if self.decode_logprob_tokens:
            return list(parent.prompt_logprobs)
        return LazyPromptLogprobs(list(parent.prompt_logprobs))  # type: ignore[arg-type]

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        if not self.decode_logprob_tokens:
            return undecoded_position_logprobs(entry)
        result: PositionLogprobs = {}
        texts = self._token_texts
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id in result:
                continue
            text = texts.get(token_id)
            if text is None:
                text = texts[token_id] = decode_token(self.tokenizer, token_id)
            result[token_id] = Logprob(logprob, rank, text)
        return result


def undecoded_position_logprobs(entry: TokenLogprobs) -> PositionLogprobs:
    """{token id: Logprob} of one position, `decoded_token` left empty; the first entry of an id wins."""
    result: PositionLogprobs = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
        if token_id not in result:
            result[token_id] = Logprob(logprob, rank)
    return result


class LazyPromptLogprobs(Sequence):
    """A request's prompt logprobs (`RequestOutput.prompt_logprobs`: one {token id: Logprob} per prompt
    position, None for the first) built from the sampler's entries when read, not on the engine thread:
    168,000 `Logprob`s for an 8,000-token prompt with 20 logprobs held every stream for ~0.3 s there
    (benchmarks/prompt_logprobs.py). `decoded_token` is left empty (the server decodes)."""

    def __init__(self, entries: list[TokenLogprobs | None]) -> None:
        self._entries = entries
        self._built: list[PositionLogprobs | None] | None = None

    def _positions(self) -> list[PositionLogprobs | None]:
        if self._built is None:
            self._built = [None if e is None else undecoded_position_logprobs(e) for e in self._entries]
        return self._built

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, index: int) -> PositionLogprobs | None: ...
    @overload
    def __getitem__(self, index: slice) -> list[PositionLogprobs | None]: ...
    def __getitem__(self, index):
        return self._positions()[index]

    def __iter__(self):
        return iter(self._positions())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, LazyPromptLogprobs)):
            return self._positions() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._positions())
