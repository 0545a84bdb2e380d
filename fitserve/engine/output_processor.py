"""From sampled tokens to RequestOutputs: detokenize, find stop strings, gather a parent's n samples."""

from __future__ import annotations

import time
from collections.abc import Sequence
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

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return [c.request_id for c in parent.children] if parent else []

    def mark_scheduled(self, child_ids: list[str], now: float) -> None:
        for child_id in child_ids:
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
        for child in progressed:
            parent = self.child_to_parent.get(child.request_id)
            if parent is None:  # aborted after its token was sampled
                continue
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            token_id = child.output_token_ids[-1]
            entry = token_logprobs.get(child.request_id)
            if entry is not None:
                parent.logprobs[child.index].append(self._position_logprobs(entry))
                parent.cumulative_logprobs[child.index] += entry.logprobs[0]
            detokenizer = parent.detokenizers[child.index]
            if detokenizer is None:
                continue
            if _ended_by_stop_token(child, parent.params.include_stop_str_in_output):
                stop = None  # the EOS / stop token's own text is left out, as vLLM does
            else:
                stop = detokenizer.add_tokens([token_id])
            if stop is None and child.is_finished:
                detokenizer.finish()  # flush a trailing partial character as decode() would
            if stop is not None and not child.is_finished:
                stopped.append((child, stop))
        return stopped

    def make_outputs(self, parent_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        now = time.time()
        for parent_id in parent_ids:
            parent = self.parents.get(parent_id)
            if parent is None:
                continue
            finished = parent.finished
            if not finished and parent.params.output_kind is RequestOutputKind.FINAL_ONLY:
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

    def _request_output(self, parent: ParentRequest, finished: bool) -> RequestOutput:
        completions = []
        want_logprobs = parent.params.logprobs is not None
        for child, detokenizer in zip(parent.children, parent.detokenizers):
            text = ""
            if detokenizer is not None:
                text = detokenizer.output_text if child.is_finished else detokenizer.stream_text(False)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=list(child.output_token_ids),
                    cumulative_logprob=parent.cumulative_logprobs[child.index] if want_logprobs else None,
                    logprobs=list(parent.logprobs[child.index]) if want_logprobs else None,
                    finish_reason=child.status.value if child.is_finished else None,
                    stop_reason=child.stop_reason,
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=self._prompt_logprobs(parent),
            metrics=parent.metrics,
            num_cached_tokens=max(parent.children[0].num_cached_tokens, 0),
            error=parent.error if finished else None,
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


def _ended_by_stop_token(child: Request, include_stop_str_in_output: bool) -> bool:
    """The child's last token is an end-of-sequence or stop_token_ids token (the scheduler finished it
    with "stop" as it was sampled: stop strings end a child only after its text is built)."""
    return child.status is RequestStatus.FINISHED_STOPPED and not include_stop_str_in_output
