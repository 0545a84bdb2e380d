"""POST /v1/completions: one or more prompts (text or token ids), each with n choices, answered as one
JSON body or as server-sent `text_completion` events ending in `data: [DONE]`.

Choice i of prompt p has index p * n + i, as in OpenAI and vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fitserve.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from fitserve.engine.request_stream import RequestStream
from fitserve.server.context import ServingContext
from fitserve.server.errors import APIError, raise_if_generation_failed
from fitserve.server.logprobs import (
    LOGPROB_FLOOR,
    completion_logprobs,
    join_completion_logprobs,
    prompt_logprobs_with_text,
)
from fitserve.server.protocol import CompletionRequest
from fitserve.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    PromptLogprob,
    UsageInfo,
    final_usage,
)
from fitserve.server.stream_reporting import StreamUsage, stream_error_event
from fitserve.server.streaming import (
    SSE_DONE,
    EventStreamResponse,
    merge_async_iterators,
    run_unless_disconnected,
    sse_event,
)

logger = logging.getLogger(__name__)

ROUTE = "/v1/completions"
MISPLACED_FIELDS = {
    "messages": "completions take a prompt; send chat messages to /v1/chat/completions",
    "tools": "tools belong to /v1/chat/completions: send the conversation there",
    "tool_choice": "tool_choice belongs to /v1/chat/completions: send the conversation there",
    "top_logprobs": "completions take logprobs as a number (e.g. logprobs: 5) instead of top_logprobs",
    "max_completion_tokens": "completions limit the output with max_tokens: send max_tokens instead",
}


@dataclass
class _Prompt:
    text: str  # for echo
    token_ids: list[int]


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        model_name = ctx.check_model(request.model)
        ctx.check_extra_fields(request, MISPLACED_FIELDS, ROUTE)
        n = ctx.check_common(request)
        if request.suffix:
            raise APIError("suffix is not supported: leave it out", param="suffix")
        ctx.check_logprobs(request.logprobs, "logprobs")
        prompt_logprobs = self._check_prompt_logprobs(request)
        prompts = await asyncio.to_thread(self._prompts, request)  # tokenizing may take a while
        if request.truncate_prompt_tokens is not None:
            prompts = [self._truncated(prompt, request) for prompt in prompts]
        # vLLM: prompt_logprobs when asked for, else the echoed prompt's logprobs (echo + logprobs).
        engine_prompt_logprobs = prompt_logprobs
        if engine_prompt_logprobs is None and request.echo:
            engine_prompt_logprobs = request.logprobs
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params_list = []
        for index, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{index}]"
            ctx.check_prompt_ids(prompt.token_ids, param)
            max_tokens = ctx.resolve_max_tokens(request.max_tokens, "max_tokens", len(prompt.token_ids))
            params_list.append(
                ctx.sampling_params(
                    request,
                    n=n,
                    max_tokens=max_tokens,
                    logprobs=request.logprobs,
                    prompt_logprobs=engine_prompt_logprobs,
                )
            )
        streams: list[RequestStream] = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                streams.append(await ctx.add_request(sub_id, prompt.text, prompt.token_ids, params))
        except BaseException as exc:
            _close_all(streams)
            if isinstance(exc, ValueError):
                raise APIError(str(exc)) from exc
            raise
        if request.stream:
            events = self._stream_events(request, request_id, streams, prompts, model_name, n)
            return EventStreamResponse(events, on_close=functools.partial(_close_all, streams))
        finals = await run_unless_disconnected(raw_request, _all_final_outputs(streams))
        raise_if_generation_failed(finals)

        def body() -> dict:
            return self._full_response(request, request_id, finals, prompts, model_name, n).model_dump()

        if request.logprobs is not None or request.prompt_logprobs is not None:
            # decoding and formatting every prompt position's top tokens (an 8,000-token prompt at 20:
            # 0.7 s on 2 CPU cores) runs beside the event loop, not on it, so other streams go on
            return JSONResponse(await asyncio.to_thread(body))
        return JSONResponse(body())

    def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            return [_Prompt(prompt, self.ctx.tokenize(prompt, request.add_special_tokens))]
        if all(isinstance(item, int) for item in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            return [_Prompt(self.ctx.decode_prompt_ids(ids, "prompt") if request.echo else "", ids)]
        self.ctx.check_prompt_count(len(prompt), "prompt")
        prompts = []
        for index, item in enumerate(prompt):
            if isinstance(item, str):
                prompts.append(_Prompt(item, self.ctx.tokenize(item, request.add_special_tokens)))
            else:
                ids = list(item)
                text = self.ctx.decode_prompt_ids(ids, f"prompt[{index}]") if request.echo else ""
                prompts.append(_Prompt(text, ids))
        return prompts

    def _truncated(self, prompt: _Prompt, request: CompletionRequest) -> _Prompt:
        ids = truncate_prompt_ids(prompt.token_ids, request.truncate_prompt_tokens, self.ctx.max_model_len)
        if len(ids) == len(prompt.token_ids):
            return prompt
        return _Prompt(self.ctx.tokenizer.decode(ids) if request.echo else "", ids)

    def _check_prompt_logprobs(self, request: CompletionRequest) -> int | None:
        """vLLM's rules: not with stream; -1 means the whole vocabulary (so --max-logprobs must allow it);
        any other negative value is refused."""
        value = request.prompt_logprobs
        if value is None:
            return None
        if request.stream:
            raise APIError(
                "prompt_logprobs are not available when stream=true: set stream to false or drop "
                "prompt_logprobs",
                param="prompt_logprobs",
            )
        if value < -1:
            raise APIError(
                f"prompt_logprobs={value} is not allowed: set it to 0 or more (-1: the whole vocabulary)",
                param="prompt_logprobs",
            )
        if value == -1:
            value = self.ctx.engine.config.model.vocab_size
        self.ctx.check_logprobs(value, "prompt_logprobs")
        return value

    def _prompt_logprobs(self, output: RequestOutput) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs` of a choice: null for the first token, then every entry the engine
        returned at each position (the prompt's token and the top ones), -inf clamped as in logprobs."""
        if output.prompt_logprobs is None:
            return None
        return [
            None
            if position is None
            else {
                token_id: PromptLogprob(
                    logprob=max(entry.logprob, LOGPROB_FLOOR),
                    rank=entry.rank,
                    decoded_token=entry.decoded_token,
                )
                for token_id, entry in position.items()
            }
            for position in prompt_logprobs_with_text(self.ctx.tokenizer, output.prompt_logprobs)
        ]

    def _logprobs(
        self,
        token_ids: list[int],
        positions: list[PositionLogprobs] | list[PositionLogprobs | None] | None,
        offset: int,
        request: CompletionRequest,
    ) -> CompletionLogprobs | None:
        if positions is None:
            return None
        as_ids = self.ctx.tokens_as_token_ids(request)
        return completion_logprobs(
            self.ctx.tokenizer, token_ids, list(positions), offset, as_token_ids=as_ids
        )

    def _echo_part(
        self, request: CompletionRequest, prompt: _Prompt, output: RequestOutput
    ) -> tuple[str, CompletionLogprobs | None]:
        if not request.echo:
            return "", None
        logprobs = None
        if request.logprobs is not None and output.prompt_logprobs is not None:
            logprobs = self._logprobs(prompt.token_ids, output.prompt_logprobs, 0, request)
        return prompt.text, logprobs

    def _full_response(
        self,
        request: CompletionRequest,
        request_id: str,
        finals: list[RequestOutput],
        prompts: list[_Prompt],
        model_name: str,
        n: int,
    ) -> CompletionResponse:
        choices = []
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            echo_text, echo_logprobs = self._echo_part(request, prompt, final)
            prompt_logprobs = self._prompt_logprobs(final) if request.prompt_logprobs is not None else None
            for choice in final.outputs:
                offset = _end_offset(echo_logprobs)
                logprobs = self._logprobs(choice.token_ids, choice.logprobs, offset, request)
                choices.append(
                    CompletionChoice(
                        index=prompt_index * n + choice.index,
                        text=echo_text + choice.text,
                        logprobs=join_completion_logprobs(echo_logprobs, logprobs),
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        usage = _usage(finals, self.ctx.settings.enable_prompt_tokens_details)
        return CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)

    async def _stream_events(
        self,
        request: CompletionRequest,
        request_id: str,
        streams: list[RequestStream],
        prompts: list[_Prompt],
        model_name: str,
        n: int,
    ) -> AsyncIterator[str]:
        stream_usage = StreamUsage.requested(
            request.stream_options, self.ctx.settings.enable_force_include_usage
        )
        progress: dict[int, _ChoiceProgress] = {}
        finals: dict[int, RequestOutput] = {}
        merged = merge_async_iterators(*streams)
        try:
            async for prompt_index, output in merged:
                raise_if_generation_failed([output])  # sent as an error event, then [DONE]
                finals[prompt_index] = output
                for choice in output.outputs:
                    index = prompt_index * n + choice.index
                    if index not in progress:
                        progress[index] = _ChoiceProgress(index, prompts[prompt_index])
                    event = self._stream_choice(request, output, choice, progress[index])
                    if event is None:
                        continue
                    usage = stream_usage.so_far(len(output.prompt_token_ids), len(choice.token_ids))
                    body = CompletionResponse(id=request_id, model=model_name, choices=[event], usage=usage)
                    yield sse_event(body.model_dump_json())
            if stream_usage.include and len(finals) == len(streams):
                usage = _usage(
                    [finals[i] for i in range(len(streams))], self.ctx.settings.enable_prompt_tokens_details
                )
                yield sse_event(
                    CompletionResponse(
                        id=request_id, model=model_name, choices=[], usage=usage
                    ).model_dump_json()
                )
        except Exception as exc:
            yield stream_error_event(exc, "completion", request_id, logger)
        finally:
            await merged.aclose()
            _close_all(streams)
        yield SSE_DONE

    def _stream_choice(
        self,
        request: CompletionRequest,
        output: RequestOutput,
        choice: CompletionOutput,
        sent: _ChoiceProgress,
    ) -> CompletionStreamChoice | None:
        """The chunk for what the choice produced since the last one; None when there is nothing new.

        New tokens make a chunk even when they add no text yet (part of a UTF-8 character, a special
        token, text held back while it may still become a stop string): as in vLLM, a client sees each
        step's tokens when they are made, so its time to first token is the first token's."""
        if sent.finished:
            return None
        new_tokens = len(choice.token_ids) > sent.num_tokens
        delta = choice.text[len(sent.text) :]
        echo_logprobs = None
        if not sent.started:
            echo_text, echo_logprobs = self._echo_part(request, sent.prompt, output)
            delta = echo_text + delta
        offset = _end_offset(echo_logprobs) if echo_logprobs is not None else sent.text_offset
        logprobs = None
        if choice.logprobs is not None:
            start = sent.num_tokens
            logprobs = self._logprobs(choice.token_ids[start:], choice.logprobs[start:], offset, request)
        joined = join_completion_logprobs(echo_logprobs, logprobs)
        sent.started, sent.finished = True, choice.finish_reason is not None
        sent.text, sent.num_tokens = choice.text, len(choice.token_ids)
        if joined is not None and joined.tokens:
            sent.text_offset = _end_offset(joined)
        if not (delta or new_tokens or sent.finished or (joined is not None and joined.tokens)):
            return None
        return CompletionStreamChoice(
            index=sent.index,
            text=delta,
            logprobs=joined,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason if sent.finished else None,
        )


@dataclass
class _ChoiceProgress:
    """What a stream has sent of one choice."""

    index: int
    prompt: _Prompt
    started: bool = False
    finished: bool = False
    text: str = ""
    num_tokens: int = 0
    text_offset: int = 0


def truncate_prompt_ids(token_ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last N prompt tokens (-1: the last max_model_len; None:
    all); N above --max-model-len is refused."""
    if truncate is None:
        return token_ids
    if truncate > max_model_len:
        raise APIError(
            f"truncate_prompt_tokens={truncate} is greater than max_model_len={max_model_len}: select a "
            f"smaller truncation size (at most {max_model_len}, or -1 for max_model_len)",
            param="truncate_prompt_tokens",
        )
    keep = max_model_len if truncate == -1 else truncate
    return token_ids[len(token_ids) - keep :] if len(token_ids) > keep else token_ids


def _end_offset(logprobs: CompletionLogprobs | None) -> int:
    if logprobs is None or not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def _usage(finals: list[RequestOutput], prompt_tokens_details: bool = False) -> UsageInfo:
    return final_usage(finals, prompt_tokens_details)


def _close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _all_final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(stream.final_output() for stream in streams)))
    finally:
        _close_all(streams)
