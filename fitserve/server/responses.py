"""Response bodies and stream chunks of the OpenAI-compatible routes, in OpenAI's shapes.

Fields listed in a model's `omit_if_none` disappear from the JSON when unset (stream deltas carry only
what changed; `reasoning_content` and `tool_calls` appear only when there are some); every other field
is always present, null included, as OpenAI sends it (`logprobs`, `finish_reason`, `content`).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer

from fitserve.core.outputs import RequestOutput


class ResponseModel(BaseModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self.omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


def now_seconds() -> int:
    return int(time.time())


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(ResponseModel):
    omit_if_none = frozenset({"prompt_tokens_details"})

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details


def final_usage(finals: list[RequestOutput], prompt_tokens_details: bool = False) -> UsageInfo:
    """The usage of finished requests (a completion's prompts together); `prompt_tokens_details`
    (--enable-prompt-tokens-details): with the prompt tokens the prefix cache held, as vLLM's
    num_cached_tokens counts them."""
    prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
    completion_tokens = sum(len(choice.token_ids) for final in finals for choice in final.outputs)
    details = None
    if prompt_tokens_details:
        details = PromptTokensDetails(cached_tokens=sum(final.num_cached_tokens for final in finals))
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(ResponseModel):
    omit_if_none = frozenset({"reasoning_content", "tool_calls"})
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(ResponseModel):
    omit_if_none = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    omit_if_none = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(ResponseModel):
    omit_if_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    omit_if_none = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionStreamChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(ResponseModel):
    """vLLM's Logprob, one per token id at a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(CompletionStreamChoice):
    """A choice of the whole response: vLLM adds `prompt_logprobs` (null unless the request asked for
    them): one entry per prompt token, null for the first, else {token id: PromptLogprob}."""

    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(ResponseModel):
    """Both the whole response and each stream chunk (OpenAI uses one object type for both)."""

    omit_if_none = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_seconds)
    model: str
    choices: list[CompletionChoice] | list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_seconds)
    owned_by: str = "fitserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    omit_if_none = frozenset({"token_strs"})
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
