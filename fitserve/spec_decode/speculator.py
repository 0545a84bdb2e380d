"""Decides, step by step, whether to speculate, and drafts tokens for the running requests.

Drafts are deterministic (prompt lookup, a draft model's greedy tokens, the oracle): a point-mass
proposal, for which rejection sampling's rule (accept draft d with probability min(1, p(d) / q(d)), else
draw from the residual) becomes: draw the target's own token at each position and accept the draft while
the draw equals it. The output is then distributed exactly as without speculation, at any temperature
(fitserve/spec_decode/verify.py).

A speculative step needs the last step's tokens on the host (the drafts continue them), so it gives up
the asynchronous scheduler's overlap; and it computes batch x (k + 1) tokens. So speculation backs off:
- by batch: no drafts when the running requests times (k + 1) exceed `MAX_VERIFY_TOKENS` (past that a
  decode step stops being bound by reading the weights and extra tokens cost real time), or when they
  reach `disable_by_batch_size` (vLLM's key);
- by acceptance: over the last `WINDOW_STEPS` speculative steps, too few accepted tokens per request and
  step pause speculation for `PAUSE_STEPS` steps, which then run with the overlap and no drafts. Too few
  is relative to what the verify cost: from `MIN_GAIN_SMALL` for a step of a few rows (a verify step that
  reads the weights once costs little more than a decode step) to `MIN_GAIN_LARGE` at `MAX_VERIFY_TOKENS`
  rows (on the H100 a verify step of 4 rows cost 1.13 decode steps for Llama-3.1-8B at batch 1). After
  a pause `PROBE_STEPS` steps judge again, and each failed probe makes the next pause `PAUSE_GROWTH`
  times longer, up to `MAX_PAUSE_STEPS`. So a workload where nothing is accepted spends a
  few steps in a thousand speculating.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from fitserve.spec_decode.config import SpeculativeConfig
from fitserve.spec_decode.ngram import propose_ngram
from fitserve.spec_decode.oracle import OracleProposer
from fitserve.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from fitserve.core.request import Request
    from fitserve.core.scheduler import SchedulerOutput

MAX_VERIFY_TOKENS = 256
WINDOW_STEPS = 4
PROBE_STEPS = 2
MIN_GAIN_SMALL = 0.1
MIN_GAIN_LARGE = 0.6
PAUSE_STEPS = 16
PAUSE_GROWTH = 4
MAX_PAUSE_STEPS = 1024


class Drafter(Protocol):
    """A model that drafts (spec_decode/draft_model.py's DraftModel, eagle3/'s head, mtp.py's MTP layer,
    which run in the worker layer beside the target's runner)."""

    def propose(self, requests: list[Request], running_ids: set[str]) -> list[list[int]]: ...

    def release(self, request_ids: Iterable[str]) -> None: ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, request: Request) -> list[int]:
        c = self.config
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        return propose_ngram(tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.num_speculative_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: Drafter | None = None) -> None:
        """`draft`: the loaded draft model of method draft_model (fitserve/spec_decode/draft_model.py),
        the EAGLE-3 head of method eagle3 (fitserve/spec_decode/eagle3/, a DraftModel) or the MTP layer
        of method mtp (fitserve/spec_decode/mtp.py, an EAGLE-3 drafter), which drafts for all the step's
        requests at once."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.draft = draft
        self.proposer: NgramProposer | OracleProposer = (
            OracleProposer(self.k) if config.method == "oracle" else NgramProposer(config)
        )
        self.stats = SpecDecodeStats(self.k)
        # (tokens accepted, requests) of the last speculative steps
        self._window: deque[tuple[int, int]] = deque(maxlen=WINDOW_STEPS)
        self._judge_after = WINDOW_STEPS  # steps in the window before it is judged
        self._pause_left = 0
        self._pause = PAUSE_STEPS

    def wants_drafts(self, running: list[Request]) -> bool:
        """Whether the next step speculates (it then needs the last step's tokens first)."""
        n = len(running)
        if n == 0:
            return False
        limit = self.config.disable_by_batch_size
        if limit is not None and n >= limit:
            return False
        if n * (self.k + 1) > MAX_VERIFY_TOKENS:
            return False
        if self._pause_left > 0:
            self._pause_left -= 1
            return False
        return True

    def propose(self, running: list[Request]) -> int:
        """Sets each decoding request's `spec_token_ids`; returns how many requests got drafts. A request
        still computing its prompt or with a token in flight gets none; one with a grammar (structured
        outputs) only the drafts its grammar accepts in a row (the verify rows are masked by the grammar
        after the drafts before each: worker/model_runner.py)."""
        drafted = 0
        decoding = []
        for request in running:
            request.spec_token_ids = []
            if request.num_output_placeholders or request.num_computed_tokens != request.num_tokens - 1:
                continue
            grammar = request.grammar
            if grammar is not None and grammar.is_terminated:
                continue
            decoding.append(request)
        if self.draft is not None:  # one batched draft for all of them
            proposals = self.draft.propose(decoding, {r.request_id for r in running})
        else:
            proposals = [self.proposer.propose(request) for request in decoding]
        for request, drafts in zip(decoding, proposals):
            grammar = request.grammar
            if drafts and grammar is not None:
                drafts = drafts[: grammar.valid_prefix_len(drafts)]
            if drafts:
                request.spec_token_ids = drafts
                drafted += 1
        if not drafted:
            self._judge(0, len(running))
        return drafted

    def after_launch(self, scheduler_output: SchedulerOutput) -> None:
        """A target step was queued: an EAGLE-3 head or the MTP layer keeps its hidden states
        (fitserve/spec_decode/eagle3/, mtp.py); nothing for the other methods."""
        keep = getattr(self.draft, "after_launch", None)
        if keep is not None:
            keep(scheduler_output)

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: a draft model gives their draft state back now (a preempted request's goes
        at its next draft)."""
        if self.draft is not None:
            self.draft.release(request_ids)

    def record_step(self, results: list[tuple[int, int]], num_requests: int) -> None:
        """A verified step: (drafts checked, drafts accepted) per drafted request, over `num_requests`
        running requests."""
        accepted = 0
        for num_drafted, num_accepted in results:
            self.stats.record(num_drafted, num_accepted)
            accepted += num_accepted
        self._judge(accepted, num_requests)

    def _judge(self, accepted: int, num_requests: int) -> None:
        self._window.append((accepted, max(num_requests, 1)))
        if len(self._window) < self._judge_after:
            return
        requests = sum(n for _, n in self._window)
        gained = sum(a for a, _ in self._window) / requests
        rows = requests / len(self._window) * (self.k + 1)
        if gained < MIN_GAIN_SMALL + (MIN_GAIN_LARGE - MIN_GAIN_SMALL) * min(1.0, rows / MAX_VERIFY_TOKENS):
            self._pause_left = self._pause
            self._pause = min(self._pause * PAUSE_GROWTH, MAX_PAUSE_STEPS)
            self._window.clear()
            self._judge_after = PROBE_STEPS
        else:
            self._pause = PAUSE_STEPS
            self._judge_after = WINDOW_STEPS
