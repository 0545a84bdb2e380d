"""Outputs across the engine process's pipe as deltas (engine_process.py sends and receives them).

A RequestOutput is cumulative: every step repeats the prompt's ids and every token and logprob so far.
Pickled whole, 128 requests with 640-token prompts and 160 tokens out make a 430 kB message (3.7 ms to
pickle on the engine's critical path, 5 ms to unpickle under the server's GIL on a 2-core CPU). Over the
pipe a request's output carries its prompt ids once (None after) and, per choice, only the token ids
and logprobs it did not send before; the text (one string) and the rest go as they are. Both sides keep
a small state per request, dropped when it finishes or is aborted (the engine says which in
`Reply.forgotten`). Output kinds are CUMULATIVE or FINAL_ONLY, so what was sent is always a prefix.
"""

from __future__ import annotations

from typing import Any

from fitserve.core.outputs import RequestOutput


class OutputEncoder:
    """The engine process's side: turns the step's fresh RequestOutputs into deltas, in place (the
    engine keeps no reference to them)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}  # request -> choice -> (tokens, logprobs)

    def encode(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            sent = self._sent.get(output.request_id)
            if sent is None:
                sent = self._sent[output.request_id] = {}
            else:
                output.prompt_token_ids = None  # type: ignore[assignment]
            for choice in output.outputs:
                tokens, logprobs = sent.get(choice.index, (0, 0))
                new_tokens, new_logprobs = len(choice.token_ids), len(choice.logprobs or ())
                if tokens:
                    choice.token_ids = choice.token_ids[tokens:]
                if logprobs and choice.logprobs is not None:
                    choice.logprobs = choice.logprobs[logprobs:]
                sent[choice.index] = (new_tokens, new_logprobs)
            if output.finished:
                del self._sent[output.request_id]
        return outputs

    def forget(self, request_id: str) -> bool:
        return self._sent.pop(request_id, None) is not None


class OutputDecoder:
    """The server's side (its receiver thread): rebuilds cumulative RequestOutputs, each with lists of
    its own (a consumer may keep an earlier output while later ones arrive)."""

    def __init__(self) -> None:
        # request -> (prompt ids, choice -> (token ids, logprobs or None)), each list grown in place
        self._requests: dict[str, tuple[list[int], dict[int, tuple[list[int], list[Any] | None]]]] = {}

    def decode(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            if output.prompt_token_ids is not None:
                state = self._requests[output.request_id] = (output.prompt_token_ids, {})
            else:
                state = self._requests.get(output.request_id, ([], {}))  # absent: aborted meanwhile
                output.prompt_token_ids = state[0]
            choices = state[1]
            for choice in output.outputs:
                known = choices.get(choice.index)
                if known is None:
                    known = choices[choice.index] = ([], None if choice.logprobs is None else [])
                tokens, logprobs = known
                tokens.extend(choice.token_ids)
                choice.token_ids = tokens.copy()
                if logprobs is not None and choice.logprobs is not None:
                    logprobs.extend(choice.logprobs)
                    choice.logprobs = logprobs.copy()
            if output.finished:
                self._requests.pop(output.request_id, None)
        return outputs

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)
