"""Test support: a ReplayEngine whose step runs out of GPU memory for chosen requests.

It keeps the engine's contract for such a step: the requests of the failed step end with a final
output whose every choice has finish_reason "error" and whose `error` is `out_of_memory_message(...)`;
the requests not in that step (here: every other one, which sits that step out) go on unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fitserve.config import DeviceConfig
from fitserve.core.outputs import RequestOutput
from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.out_of_memory import out_of_memory_message
from tests.unit.server_helpers import ReplayEngine, _Replay

TORCH_OOM_TEXT = (
    "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "0.75 GiB is free."
)


class OutOfMemoryReplayEngine(ReplayEngine):
    """Replays like ReplayEngine; a request whose prompt `fails(prompt)` picks ends, once each of its
    choices has `after_tokens` tokens, in a step that runs out of memory."""

    def __init__(
        self,
        script: Callable[[str, int], str],
        fails: Callable[[str], bool],
        after_tokens: int = 2,
        step_delay_s: float = 0.0,
    ) -> None:
        super().__init__(script, step_delay_s=step_delay_s)
        self.fails = fails
        self.after_tokens = after_tokens
        self.doomed: set[str] = set()
        # One entry per failed step: (the requests it ended, the requests in flight beside them).
        self.failed_steps: list[tuple[list[str], list[str]]] = []
        self.message_config = dataclasses.replace(self.config, device=DeviceConfig("cuda"))

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> None:
        super().add_request(request_id, prompt, prompt_token_ids, params)
        text = prompt if prompt is not None else self.tokenizer.decode(prompt_token_ids or [])
        if self.fails(text):
            self.doomed.add(request_id)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (0 tokens): send at least one token of text")

    def step(self) -> list[RequestOutput]:
        failing = [
            replay
            for request_id, replay in self.requests.items()
            if request_id in self.doomed and all(len(e) >= self.after_tokens for e in replay.emitted)
        ]
        if not failing:
            return super().step()
        for replay in failing:
            del self.requests[replay.request_id]
        others = list(self.requests)
        self.failed_steps.append(([r.request_id for r in failing], others))
        num_tokens = sum(len(r.prompt_token_ids) + len(r.emitted[0]) for r in failing)
        num_seqs = sum(len(r.scripts) for r in failing)
        error = torch.OutOfMemoryError(TORCH_OOM_TEXT)
        message = out_of_memory_message(self.message_config, num_tokens, num_seqs, error)
        self.stats.num_running = len(self.requests)
        return [self._failed_output(replay, message) for replay in failing]

    def _failed_output(self, replay: _Replay, message: str) -> RequestOutput:
        output = self._output(replay, finished=True)
        for choice in output.outputs:
            choice.finish_reason = "error"
        output.error = message
        return output
