"""Request bodies of the OpenAI-compatible routes (pydantic), with vLLM's extra sampling fields.

Top-level fields a route does not know are kept in `model_extra`: the route refuses those that belong
to another route (e.g. `messages` sent to /v1/completions) and ignores the rest with a log line, as
vLLM does, so gateways that add their own fields keep working. Nested objects (stream_options, tool
definitions) refuse unknown fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolParam(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenAIBaseModel):
    """OpenAI's response_format.json_schema: {name, description, schema, strict}."""

    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema: stored as json_schema, read and written as "schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallParam(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIBaseModel):
    """One message of the history; extra keys (e.g. a vendor's) are handed to the template as they are.
    Roles besides OpenAI's (system, developer, user, assistant, tool) reach the template unchanged, as in
    vLLM: a template that knows a custom role (e.g. "ipython") renders it."""

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role in ("system", "developer", "user", "tool"):
            raise ValueError(
                f"a {self.role} message needs content: add a content string or a list of text parts"
            )
        return self


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and completions; None means "the model's or vLLM's default"."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool | None = None
    best_of: int | None = None
    use_beam_search: bool | None = None
    # vLLM: with use_beam_search, the final ranking divides the cumulative logprob by length ** this.
    length_penalty: float | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    # vLLM: keep only the last N prompt tokens (-1: as many as the context holds; None/0 handled below).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    return_tokens_as_token_ids: bool | None = None
    # Structured outputs (docs/structured_outputs.md): OpenAI's response_format, vLLM's
    # structured_outputs ({json | regex | choice | grammar | json_object: ...}) and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise ValueError("stop must be a string or a list of strings")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: with echo, the last message's content (when it is the assistant's) starts the reply.
    echo: bool = False


# Token ids are strict integers: true/false are refused (pydantic would take them as 1/0).
TokenIds = list[StrictInt]


def check_prompt_shape(value: Any) -> Any:
    """A prompt is a string, a list of strings, a list of token ids or a list of token-id lists."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        if all(_is_token_id(item) for item in value):
            return value
        if all(isinstance(item, list) and item and all(_is_token_id(t) for t in item) for item in value):
            return value
    raise ValueError(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists "
        "(none of them empty)"
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    max_tokens: int | None = 16
    add_special_tokens: bool = True

    _prompt_shape = field_validator("prompt", mode="before")(check_prompt_shape)


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either a `prompt` or chat `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (a string) or messages (a chat history)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty: send at least one message, or send prompt instead")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds
