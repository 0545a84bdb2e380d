"""POST /v1/chat/completions: render the history, generate, parse reasoning and tool calls, answer
as one JSON body or as server-sent `chat.completion.chunk` events ending in `data: [DONE]`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fitserve.core.outputs import CompletionOutput, RequestOutput
from fitserve.engine.request_stream import RequestStream
from fitserve.server.choice_parsing import ChoiceParser, final_finish_reason
from fitserve.server.context import ServingContext
from fitserve.server.errors import APIError, raise_if_generation_failed
from fitserve.server.logprobs import chat_logprob_entries
from fitserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ToolCallDelta, ToolParser
from fitserve.server.parsers.forced_tools import NamedToolParser, RequiredToolsParser
from fitserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from fitserve.server.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    UsageInfo,
    final_usage,
)
from fitserve.server.serving_completion import truncate_prompt_ids
from fitserve.server.stream_reporting import StreamUsage, stream_error_event
from fitserve.server.streaming import SSE_DONE, EventStreamResponse, run_unless_disconnected, sse_event
from fitserve.structured.tools import named_tool_schema, required_tools_schema

logger = logging.getLogger(__name__)

ROUTE = "/v1/chat/completions"
MISPLACED_FIELDS = {
    "prompt": "chat takes messages; send the prompt as a user message, or send it to /v1/completions",
    "suffix": "suffix belongs to /v1/completions (and is not supported there either)",
    "functions": "functions is OpenAI's retired form of tools: send tools instead",
    "function_call": "function_call is OpenAI's retired form of tool_choice: send tool_choice instead",
}


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        model_name = ctx.check_model(request.model)
        ctx.check_extra_fields(request, MISPLACED_FIELDS, ROUTE)
        n = ctx.check_common(request)
        tool_structured = self._forced_tool_choice(request)
        tool_parser_cls = None if tool_structured is not None else self._tool_parser_class(request)
        self._keep_special_tokens_for_parsers(request, tool_parser_cls)
        ctx.check_logprobs(request.top_logprobs, "top_logprobs")
        prompt_text, prompt_ids = await ctx.render_chat(request, request.add_special_tokens)
        prompt_ids = truncate_prompt_ids(prompt_ids, request.truncate_prompt_tokens, ctx.max_model_len)
        ctx.check_prompt_ids(prompt_ids, "messages")
        field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        requested = request.max_completion_tokens if field == "max_completion_tokens" else request.max_tokens
        max_tokens = ctx.resolve_max_tokens(requested, field, len(prompt_ids))
        num_top = request.top_logprobs or 0
        params = ctx.sampling_params(
            request,
            n=n,
            max_tokens=max_tokens,
            logprobs=num_top if request.logprobs else None,
            tool_structured=tool_structured,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            stream = await ctx.add_request(request_id, prompt_text, prompt_ids, params)
        except ValueError as exc:
            raise APIError(str(exc)) from exc
        parsers = [self._choice_parser(prompt_text, tool_parser_cls, request) for _ in range(n)]
        echo = self._echo_text(request)
        as_ids = ctx.tokens_as_token_ids(request)
        if request.stream:
            events = self._stream_events(
                request, stream, model_name, parsers, num_top, echo, len(prompt_ids), as_ids
            )
            return EventStreamResponse(events, on_close=stream.close)
        final = await run_unless_disconnected(raw_request, stream.final_output())
        raise_if_generation_failed([final])
        response = self._full_response(final, model_name, parsers, num_top, echo, as_ids)
        return JSONResponse(response.model_dump())

    def _echo_text(self, request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content starts the reply when it has the reply's role
        (the response role after a generation prompt, else the last message's own, as with
        continue_final_message); otherwise nothing."""
        if not request.echo:
            return ""
        last = request.messages[-1]
        role = self.ctx.settings.response_role if request.add_generation_prompt else last.role
        if last.role != role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(str(part.get("text", "")) for part in last.content if part.get("type") == "text")

    @staticmethod
    def _forced_tool_choice(request: ChatCompletionRequest) -> dict[str, Any] | None:
        """tool_choice "required" or a named function: the structured output that holds the reply to
        valid calls of the tools (fitserve/structured/tools.py), as structured_outputs fields; None for
        "auto" and "none"."""
        choice = request.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return None
        tools = [tool.model_dump() for tool in request.tools or []]
        if not tools:
            what = '"required"' if choice == "required" else f"naming the function {choice.function.name!r}"
            raise APIError(
                f"tool_choice {what} needs tools: add the tools the model may call to tools",
                param="tool_choice",
            )
        try:
            if choice == "required":
                return {"json": required_tools_schema(tools, request.parallel_tool_calls is not False)}
            return {"json": named_tool_schema(tools, choice.function.name)}
        except ValueError as exc:
            raise APIError(str(exc), param="tool_choice") from None

    def _tool_parser_class(self, request: ChatCompletionRequest) -> type[ToolParser] | None:
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if request.tools else "none"
        if choice == "none":
            return None
        if not request.tools:
            raise APIError('tool_choice "auto" needs tools: add tools to the request', param="tool_choice")
        settings = self.ctx.settings
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise APIError(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                '--tool-call-parser (e.g. hermes); or send tool_choice "none"',
                param="tool_choice",
            )
        return TOOL_CALL_PARSERS[settings.tool_call_parser]

    def _keep_special_tokens_for_parsers(
        self, request: ChatCompletionRequest, tool_parser_cls: type[ToolParser] | None
    ) -> None:
        """Parsers whose tags are special tokens (gemma4) need them in the text: as vLLM's adjust_request,
        such a reasoning parser sets skip_special_tokens false for every request, such a tool parser for
        requests it parses (tools given, tool_choice not "none")."""
        name = self.ctx.settings.reasoning_parser
        reasoning_cls = REASONING_PARSERS[name] if name else None
        if any(cls is not None and cls.keeps_special_tokens for cls in (reasoning_cls, tool_parser_cls)):
            request.skip_special_tokens = False

    def _choice_parser(
        self, prompt_text: str, tool_parser_cls: type[ToolParser] | None, request: ChatCompletionRequest
    ) -> ChoiceParser:
        name = self.ctx.settings.reasoning_parser
        reasoning = REASONING_PARSERS[name](prompt_text) if name else None
        tool_dicts = [t.model_dump() for t in request.tools or []]
        tools: ToolParser | None = tool_parser_cls(tool_dicts) if tool_parser_cls else None
        if request.tool_choice == "required":
            tools = RequiredToolsParser(tool_dicts)
        elif isinstance(request.tool_choice, NamedToolChoice):
            tools = NamedToolParser(tool_dicts, request.tool_choice.function.name)
        return ChoiceParser(reasoning, tools)

    def _logprobs(
        self, choice: CompletionOutput, start: int, num_top: int, as_token_ids: bool = False
    ) -> ChatChoiceLogprobs | None:
        if choice.logprobs is None:
            return None
        entries = chat_logprob_entries(
            self.ctx.tokenizer, choice.token_ids[start:], choice.logprobs[start:], num_top, as_token_ids
        )
        return ChatChoiceLogprobs(content=entries)

    def _full_response(
        self,
        final: RequestOutput,
        model_name: str,
        parsers: list[ChoiceParser],
        num_top: int,
        echo: str = "",
        as_token_ids: bool = False,
    ) -> ChatCompletionResponse:
        choices = []
        for choice in final.outputs:
            parser = parsers[choice.index]
            parsed = parser.parse(choice.text)
            if echo:
                parsed.content = echo + (parsed.content or "")
            tool_calls = [
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in parsed.tool_calls
            ]
            message = ChatResponseMessage(
                role=self.ctx.settings.response_role,
                content=parsed.content,
                reasoning_content=parsed.reasoning,
                tool_calls=tool_calls or None,
            )
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=self._logprobs(choice, 0, num_top, as_token_ids),
                    finish_reason=final_finish_reason(choice.finish_reason, parser.called_tools),
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=final.request_id,
            model=model_name,
            choices=choices,
            usage=_usage(final, self.ctx.settings.enable_prompt_tokens_details),
        )

    async def _stream_events(
        self,
        request: ChatCompletionRequest,
        stream: RequestStream,
        model_name: str,
        parsers: list[ChoiceParser],
        num_top: int,
        echo: str = "",
        num_prompt_tokens: int = 0,
        as_token_ids: bool = False,
    ) -> AsyncIterator[str]:
        request_id = stream.request_id

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(id=request_id, model=model_name, choices=choices, usage=usage)
            return sse_event(body.model_dump_json())

        stream_usage = StreamUsage.requested(
            request.stream_options, self.ctx.settings.enable_force_include_usage
        )
        sent_text = [""] * len(parsers)
        sent_tokens = [0] * len(parsers)
        done = [False] * len(parsers)
        final: RequestOutput | None = None
        try:
            role = DeltaMessage(role=self.ctx.settings.response_role, content="")
            for index in range(len(parsers)):
                yield chunk(
                    [ChatStreamChoice(index=index, delta=role)], stream_usage.so_far(num_prompt_tokens, 0)
                )
            if echo:
                for index in range(len(parsers)):
                    yield chunk(
                        [ChatStreamChoice(index=index, delta=DeltaMessage(content=echo))],
                        stream_usage.so_far(num_prompt_tokens, 0),
                    )
            async for output in stream:
                raise_if_generation_failed([output])  # sent as an error event, then [DONE]
                final = output
                for choice in output.outputs:
                    i = choice.index
                    if done[i]:
                        continue
                    finished = choice.finish_reason is not None
                    new_text = choice.text[len(sent_text[i]) :]
                    # Tokens that add no text yet (part of a UTF-8 character, a special token) still
                    # make a chunk, with empty content, as in vLLM: the client sees each step's tokens
                    # when they are made. Text a parser holds back (a tool call in progress) makes none.
                    silent_tokens = len(choice.token_ids) > sent_tokens[i] and not new_text
                    parsed = parsers[i].feed(new_text, finished)
                    sent_text[i] = choice.text
                    logprobs = self._logprobs(choice, sent_tokens[i], num_top, as_token_ids)
                    sent_tokens[i] = len(choice.token_ids)
                    delta = DeltaMessage(
                        content=parsed.content if parsed.content or not silent_tokens else "",
                        reasoning_content=parsed.reasoning,
                        tool_calls=[_delta_tool_call(c) for c in parsed.tool_calls] or None,
                    )
                    has_logprobs = logprobs is not None and bool(logprobs.content)
                    if not (
                        finished
                        or silent_tokens
                        or has_logprobs
                        or delta.content
                        or delta.reasoning_content
                        or delta.tool_calls
                    ):
                        continue
                    reason = final_finish_reason(choice.finish_reason, parsers[i].called_tools)
                    stream_choice = ChatStreamChoice(
                        index=i,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=reason,
                        stop_reason=choice.stop_reason if finished else None,
                    )
                    done[i] = finished
                    yield chunk(
                        [stream_choice], stream_usage.so_far(num_prompt_tokens, len(choice.token_ids))
                    )
            if stream_usage.include and final is not None:
                yield chunk([], usage=_usage(final, self.ctx.settings.enable_prompt_tokens_details))
        except Exception as exc:
            yield stream_error_event(exc, "chat", request_id, logger)
        finally:
            stream.close()
        yield SSE_DONE


def _delta_tool_call(call: ToolCallDelta) -> DeltaToolCall:
    return DeltaToolCall(
        index=call.index,
        id=call.id,
        type="function" if call.id is not None else None,
        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
    )


def _usage(output: RequestOutput, prompt_tokens_details: bool = False) -> UsageInfo:
    return final_usage([output], prompt_tokens_details)
