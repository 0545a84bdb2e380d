"""Outputs across the engine process's pipe as deltas (engine_process.py sends and receives them).

A RequestOutput is cumulative: every step repeats the prompt, its ids and every token, logprob and
character so far. Pickled whole, 128 requests with 640-token prompts and 160 tokens out make a 430 kB
message (3.7 ms to pickle on the engine's critical path, 5 ms to unpickle under the server's GIL on a
2-core CPU). Over the pipe a request's output carries its prompt and prompt ids once (None after) and, per
choice, only the token ids, logprobs and text it did not send before. It travels as plain tuples, not
as dataclasses: pickling 256 one-choice RequestOutputs (already deltas) took 1.46 ms against 0.07 ms for
the same values in tuples on the 2-core development CPU (the whole send: benchmarks/host_step.py). Both
sides keep a small state per request, dropped when it finishes or is
aborted (the engine says which in `Reply.forgotten`). Output kinds are CUMULATIVE or FINAL_ONLY, so what
was sent is always a prefix; a text that does not extend what was sent (never expected) goes whole.
"""

from __future__ import annotations

from typing import Any

from fitserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput

# RequestOutput's and CompletionOutput's fields in the order the tuples below carry them
# (tests/unit/test_engine_process.py checks them against the dataclasses).
OUTPUT_FIELDS = (
    "request_id",
    "prompt",
    "prompt_token_ids",
    "outputs",
    "finished",
    "prompt_logprobs",
    "metrics",
    "num_cached_tokens",
    "extra",
    "error",
)
CHOICE_FIELDS = (
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "finish_reason",
    "stop_reason",
)
METRICS_FIELDS = (
    "arrival_time",
    "first_scheduled_time",
    "first_token_time",
    "last_token_time",
    "finished_time",
    "max_tokens_param",
)

# One choice on the wire: (index, text, text_is_whole, new token ids, cumulative_logprob, new logprobs or
# None, finish_reason, stop_reason); `text` is what follows the text sent before unless text_is_whole.
WireChoice = tuple[int, str, bool, list[int], float | None, list[Any] | None, str | None, Any]
# One output: (request_id, prompt, prompt ids (None after the first), finished, prompt_logprobs,
# metrics as a tuple of METRICS_FIELDS (or None), num_cached_tokens, extra (None when empty), error,
# choices)
WireOutput = tuple[Any, ...]


class OutputEncoder:
    """The engine process's side: turns the step's fresh RequestOutputs into wire tuples of deltas."""

    def __init__(self) -> None:
        # request -> choice -> [tokens, logprobs, the text] sent
        self._sent: dict[str, dict[int, list]] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[WireOutput]:
        wire = []
        sent_of = self._sent
        for output in outputs:
            request_id = output.request_id
            sent = sent_of.get(request_id)
            prompt, prompt_ids = None, None
            if sent is None:
                sent = sent_of[request_id] = {}
                prompt, prompt_ids = output.prompt, output.prompt_token_ids
            choices = output.outputs
            if len(choices) == 1:  # n = 1: no comprehension to build
                choices = [_wire_choice(choices[0], sent)]
            else:
                choices = [_wire_choice(choice, sent) for choice in choices]
            metrics = output.metrics
            wire.append(
                (
                    request_id,
                    prompt,
                    prompt_ids,
                    output.finished,
                    output.prompt_logprobs,
                    None
                    if metrics is None
                    else (
                        metrics.arrival_time,
                        metrics.first_scheduled_time,
                        metrics.first_token_time,
                        metrics.last_token_time,
                        metrics.finished_time,
                        metrics.max_tokens_param,
                    ),
                    output.num_cached_tokens,
                    output.extra or None,
                    output.error,
                    choices,
                )
            )
            if output.finished:
                del sent_of[request_id]
        return wire

    def forget(self, request_id: str) -> bool:
        return self._sent.pop(request_id, None) is not None


def _wire_choice(choice: CompletionOutput, sent: dict[int, list]) -> WireChoice:
    """A choice's wire tuple; `sent` (choice -> [tokens, logprobs, text] sent) is brought up to date
    in place."""
    index, token_ids, logprobs, text = choice.index, choice.token_ids, choice.logprobs, choice.text
    state = sent.get(index)
    if state is None:
        state = sent[index] = [0, 0, ""]
    tokens, num_logprobs, sent_text = state
    new_logprobs = None
    if logprobs is not None:
        new_logprobs = logprobs[num_logprobs:] if num_logprobs else logprobs
        state[1] = len(logprobs)
    text_is_whole = not text.startswith(sent_text)
    state[0] = len(token_ids)
    state[2] = text
    return (
        index,
        text if text_is_whole or not sent_text else text[len(sent_text) :],
        text_is_whole,
        token_ids[tokens:] if tokens else token_ids,
        choice.cumulative_logprob,
        new_logprobs,
        choice.finish_reason,
        choice.stop_reason,
    )


class OutputDecoder:
    """The server's side (its receiver thread): rebuilds cumulative RequestOutputs, each with lists of
    its own (a consumer may keep an earlier output while later ones arrive)."""

    def __init__(self) -> None:
        # request -> (prompt, prompt ids, choice -> (token ids, logprobs or None, text)), the lists grown
        # in place
        self._requests: dict[str, tuple[str | None, list[int], dict[int, list[Any]]]] = {}

    def decode(self, wire: list[Any]) -> list[RequestOutput]:
        """Turns the wire tuples of `wire` into cumulative RequestOutputs, in place; returns the list."""
        requests = self._requests
        for position, (
            request_id,
            prompt,
            prompt_ids,
            finished,
            prompt_logprobs,
            metrics,
            num_cached_tokens,
            extra,
            error,
            wire_choices,
        ) in enumerate(wire):
            if prompt_ids is not None:
                state = requests[request_id] = (prompt, prompt_ids, {})
            else:
                state = requests.get(request_id, (None, [], {}))  # absent: aborted meanwhile
            prompt, prompt_ids, known_choices = state
            choices = []
            for index, text, text_is_whole, token_ids, cumulative, logprobs, finish, stop in wire_choices:
                known = known_choices.get(index)
                if known is None:
                    known = known_choices[index] = [[], None if logprobs is None else [], ""]
                tokens, known_logprobs, _ = known
                tokens.extend(token_ids)
                if known_logprobs is not None and logprobs is not None:
                    known_logprobs.extend(logprobs)
                    logprobs = known_logprobs.copy()
                known[2] = text = text if text_is_whole else known[2] + text
                choices.append(
                    CompletionOutput(index, text, tokens.copy(), cumulative, logprobs, finish, stop)
                )
            wire[position] = RequestOutput(
                request_id,
                prompt,
                prompt_ids,
                choices,
                finished,
                prompt_logprobs,
                None if metrics is None else RequestMetrics(*metrics),
                num_cached_tokens,
                {} if extra is None else extra,
                error,
            )
            if finished:
                requests.pop(request_id, None)
        return wire

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)
