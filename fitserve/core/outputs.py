"""What the engine hands back: vLLM's RequestOutput and CompletionOutput, cumulative per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per token position: the chosen token plus the top-k, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class TokenLogprobs:
    """The sampler's logprobs at one position, before detokenization (the output processor turns them into
    `PositionLogprobs`). Index 0 is the sampled (or given) token; then the top-k tokens by raw logprob, most
    likely first.

    rank = 1 + the number of other tokens whose logprob is at least this token's (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    max_tokens_param: int | None = None  # the request's max_tokens (for vllm:request_params_max_tokens)


@dataclass
class RequestOutput:
    """Everything generated so far for one request (text and token ids only ever grow)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # Why the request ended early (e.g. the device ran out of memory in its step), with what to change;
    # set only on a final output whose choices all have finish_reason "error".
    error: str | None = None

    def __repr__(self) -> str:
        texts = [o.text for o in self.outputs]
        error = f", error={self.error!r}" if self.error is not None else ""
        return (
            f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, texts={texts!r}{error})"
        )
