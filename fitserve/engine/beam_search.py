"""Beam search, as vLLM offers it: `LLM.beam_search(prompts, BeamSearchParams(...))` and the server's
`use_beam_search: true`.

The search is the `BeamSearch` class, one per prompt, and knows nothing of engines: it hands out the
sequences to extend (`pending()`), takes each one's candidate next tokens with their logprobs
(`advance()`) and finally ranks what it found (`output()`). Two drivers feed it: `run_beam_search` (the
synchronous `Engine`, for `LLM`) and `BeamSearchStream` (the `AsyncEngine`, for the server). Both ask the
engine, for every live beam, one token with `2 * beam_width` logprobs (`expansion_params`); the prefix
cache keeps the beams' shared prefix, so each expansion computes about one new token.

vLLM's rules, kept here:
- every candidate (a live beam plus one of its top tokens) scores its cumulative logprob; an end-of-
  sequence candidate (unless ignore_eos) leaves the search as a finished sequence, the others compete
  for the `beam_width` live places;
- after max_tokens steps (or when a beam reaches max_model_len) the live beams finish too;
- the finished sequences are ranked by `beam_search_score`: cumulative_logprob / length ** length_penalty,
  where length counts the prompt and the generated tokens, less a final end-of-sequence token; the best
  `beam_width` are returned, best first;
- the text leaves out a final end-of-sequence token unless include_stop_str_in_output.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fitserve.core.outputs import CompletionOutput, RequestOutput
from fitserve.core.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from fitserve.engine.async_engine import AsyncEngine
    from fitserve.engine.engine import Engine

# One candidate next token: (token id, its logprob).
Candidate = tuple[int, float]


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`. beam_width: beams kept at each step and sequences returned; max_tokens:
    most tokens to generate; temperature: the one-token requests' temperature (0 = greedy; above it the
    sampled token joins the top tokens as a candidate, as in vLLM); length_penalty: exponent of the length
    the final ranking divides the cumulative logprob by (0 = rank by cumulative logprob alone)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name}={value!r} must be an integer of at least 1: set {name} to 1 or more"
                )
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature={temperature!r} must be 0 or more: set temperature to 0 (greedy)")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise ValueError(
                f"length_penalty={penalty!r} must be a finite number: set length_penalty to e.g. 1.0 "
                "(0 ranks by cumulative logprob alone)"
            )


@dataclass
class BeamSearchSequence:
    """One returned sequence. As in vLLM, `tokens` holds the prompt's tokens and then the generated ones
    (`output_token_ids` are the generated ones alone) and `cum_logprob` sums the generated tokens'
    logprobs."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (end of sequence) or "length"
    num_prompt_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float:
        return self.cum_logprob

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """vLLM's `BeamSearchOutput`: the best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_ids: Collection[int], length_penalty: float
) -> float:
    """vLLM's ranking score: cum_logprob / length ** length_penalty; the length counts the prompt and the
    output, less a final end-of-sequence token."""
    length = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        length -= 1
    return cum_logprob / (max(length, 1) ** length_penalty)


def check_beam_width(beam_width: int, vocab_size: int) -> None:
    """Each beam asks for 2 * beam_width candidate tokens, which the vocabulary must hold."""
    if 2 * beam_width > vocab_size:
        raise ValueError(
            f"beam_width={beam_width} is above the limit {vocab_size // 2} for this model (each step ranks "
            f"2 x beam_width candidate tokens of a {vocab_size}-token vocabulary): set beam_width to "
            f"{vocab_size // 2} or less"
        )


def expansion_params(params: BeamSearchParams) -> SamplingParams:
    """The one-token request every live beam sends at every step."""
    return SamplingParams(
        n=1,
        temperature=params.temperature,
        max_tokens=1,
        ignore_eos=True,
        logprobs=2 * params.beam_width,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def candidates_of(output: RequestOutput) -> list[Candidate]:
    """The candidates a finished one-token request found: its sampled token and the top tokens."""
    if output.error is not None:
        raise RuntimeError(output.error)
    choice = output.outputs[0]
    if choice.finish_reason == "abort":
        raise RuntimeError(f"beam search step {output.request_id} was aborted")
    if not choice.logprobs:
        raise RuntimeError(f"beam search step {output.request_id} returned no logprobs")
    return [(token_id, entry.logprob) for token_id, entry in choice.logprobs[0].items()]


class BeamSearch:
    """The search for one prompt: `pending()` the sequences to extend, `advance()` with each one's
    candidates, until `done`; then `output()`."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.steps = 0
        self.live = [BeamSearchSequence(list(self.prompt_token_ids), num_prompt_tokens=len(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.live

    def pending(self) -> list[list[int]]:
        """The token ids (prompt + generated) of every live beam, in order."""
        return [beam.tokens for beam in self.live]

    def advance(self, candidates: Sequence[Sequence[Candidate]]) -> None:
        """One step: `candidates[i]` are live beam i's next tokens with their logprobs."""
        if len(candidates) != len(self.live):
            raise ValueError(f"got candidates for {len(candidates)} beams, {len(self.live)} are live")
        params = self.params
        extended: list[BeamSearchSequence] = []
        for beam, options in zip(self.live, candidates):
            for token_id, logprob in options:
                child = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.cum_logprob + logprob,
                    num_prompt_tokens=beam.num_prompt_tokens,
                )
                if token_id in self.eos_token_ids and not params.ignore_eos:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    extended.append(child)
        # Every live beam has the same length: ranking by score is ranking by cumulative logprob.
        extended.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.live = extended[: params.beam_width]
        self.steps += 1
        if self.steps >= params.max_tokens or any(len(b.tokens) >= self.max_model_len for b in self.live):
            for beam in self.live:
                beam.finish_reason = "length"
            self.finished.extend(self.live)
            self.live = []

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty
        )

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The best beam_width finished sequences, best first, their text decoded by `decode`."""
        ranked = sorted(self.finished, key=self.score, reverse=True)[: self.params.beam_width]
        for beam in ranked:
            tokens = beam.output_token_ids
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                tokens = tokens[:-1]
            beam.text = decode(tokens)
        return BeamSearchOutput(ranked)


def as_request_output(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], result: BeamSearchOutput
) -> RequestOutput:
    """A finished RequestOutput with one choice per sequence, best first (for the server's handlers)."""
    choices = [
        CompletionOutput(
            index=index,
            text=sequence.text or "",
            token_ids=sequence.output_token_ids,
            cumulative_logprob=sequence.cum_logprob,
            logprobs=None,
            finish_reason=sequence.finish_reason,
        )
        for index, sequence in enumerate(result.sequences)
    ]
    return RequestOutput(request_id, prompt, list(prompt_token_ids), choices, finished=True)


def run_beam_search(engine: Engine, searches: list[BeamSearch], request_prefix: str) -> None:
    """Drives `searches` to the end on the synchronous engine: each step sends every live beam of every
    search as a one-token request, steps the engine until they are all back, and advances the searches."""
    step = 0
    while True:
        active = [search for search in searches if not search.done]
        if not active:
            return
        sent: list[list[str]] = []
        for search_index, search in enumerate(active):
            params = expansion_params(search.params)
            ids = []
            for beam_index, tokens in enumerate(search.pending()):
                request_id = f"{request_prefix}-{search_index}-{step}-{beam_index}"
                engine.add_request(request_id, None, tokens, params)
                ids.append(request_id)
            sent.append(ids)
        results: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
        except BaseException:
            engine.abort_request([rid for ids in sent for rid in ids if rid not in results])
            raise
        for search, ids in zip(active, sent):
            search.advance([candidates_of(results[rid]) for rid in ids])
        step += 1


def decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return lambda token_ids: tokenizer.decode(token_ids)


class BeamSearchStream:
    """One beam search on the AsyncEngine, with the consumer side of `RequestStream` (async iteration,
    `final_output()`, `close()`): it yields a single, final RequestOutput, its choices best first. Closing
    it early cancels the search, which aborts its one-token requests."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
    ) -> None:
        self.request_id = request_id
        self.num_choices = params.beam_width
        self.finished = False
        self._engine = engine
        self._prompt = prompt
        self._search = BeamSearch(
            prompt_token_ids,
            params,
            engine.engine.eos_token_ids,
            engine.config.model.max_model_len,
        )
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> RequestOutput:
        search, step = self._search, 0
        params = expansion_params(search.params)
        while not search.done:
            streams = []
            try:
                for index, tokens in enumerate(search.pending()):
                    rid = f"{self.request_id}-beam{step}-{index}"
                    streams.append(await self._engine.add_request(rid, None, tokens, params))
                finals = await asyncio.gather(*(stream.final_output() for stream in streams))
            finally:
                for stream in streams:
                    stream.close()
            search.advance([candidates_of(final) for final in finals])
            step += 1
        tokenizer = self._engine.tokenizer
        result = await asyncio.to_thread(search.output, decoder(tokenizer))
        return as_request_output(self.request_id, self._prompt, search.prompt_token_ids, result)

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            return await self.final_output()
        finally:
            self.finished = True

    async def final_output(self) -> RequestOutput:
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            self.close()
            raise

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled():
            with contextlib.suppress(BaseException):
                self._task.exception()  # retrieved: no "exception was never retrieved" warning
        self.finished = True

    async def aclose(self) -> None:
        self.close()
