"""For benchmarks only: drafts read from answers computed in a first, non-speculative pass.

`speculative_config={"method": "oracle", "num_speculative_tokens": k}` and then
`OracleProposer.load(prompts, outputs)` (the engine's `speculator.proposer`): a request whose prompt
is one of `prompts` is drafted the next k tokens of its answer, so every draft is accepted and a step's
cost is the mechanics alone, without a drafter's quality in the way. `load(..., miss=True)` drafts
tokens that are never the answer's (each answer token + 1), so none is accepted: speculation's cost at
zero acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitserve.core.request import Request


class OracleProposer:
    def __init__(self, k: int) -> None:
        self.k = k
        self.answers: dict[tuple[int, ...], list[int]] = {}
        self.vocab_size: int | None = None
        self.miss = False

    def load(
        self,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        miss: bool = False,
    ) -> None:
        self.answers = {tuple(p): list(o) for p, o in zip(prompts, outputs)}
        self.vocab_size = vocab_size
        self.miss = miss

    def propose(self, request: Request) -> list[int]:
        answer = self.answers.get(tuple(request.prompt_token_ids))
        if answer is None:
            return []
        done = request.num_output_tokens
        drafts = answer[done : done + self.k]
        if self.miss and self.vocab_size:
            drafts = [(t + 1) % self.vocab_size for t in drafts]
        return drafts
