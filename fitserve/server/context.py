"""What every route needs: the engine, the settings, the served names, and the checks shared by
chat and completions (model name, misplaced fields, prompt length, sampling parameters)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.async_engine import AsyncEngine
from fitserve.server.args import ServerSettings
from fitserve.server.chat import ChatRenderer
from fitserve.server.errors import APIError
from fitserve.server.protocol import ChatCompletionRequest, OpenAIBaseModel, SamplingRequest, TokenizeRequest

logger = logging.getLogger(__name__)

# OpenAI's and vLLM's default cap on top log-probabilities per token.
MAX_LOGPROBS = 20
# Fields the engine's generation_config.json may set for requests that leave them out.
_MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ServingContext:
    engine: AsyncEngine
    settings: ServerSettings
    served_model_names: tuple[str, ...]
    model_path: str
    max_model_len: int
    max_num_seqs: int
    renderer: ChatRenderer
    generation_defaults: dict[str, Any]

    @classmethod
    def create(cls, engine: AsyncEngine, settings: ServerSettings) -> ServingContext:
        model_config = engine.config.model
        names = tuple(model_config.served_model_name) or (model_config.model,)
        renderer = ChatRenderer(
            engine.tokenizer, settings.chat_template, settings.chat_template_content_format
        )
        return cls(
            engine=engine,
            settings=settings,
            served_model_names=names,
            model_path=model_config.model_path,
            max_model_len=model_config.max_model_len,
            max_num_seqs=engine.config.scheduler.max_num_seqs,
            renderer=renderer,
            generation_defaults=dict(getattr(engine.engine, "generation_defaults", {}) or {}),
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, requested: str | None) -> str:
        """The name to report; a request naming another model is a 404."""
        if requested is None or requested == "" or requested in self.served_model_names:
            return requested or self.model_name
        served = ", ".join(repr(name) for name in self.served_model_names)
        raise APIError(
            f"The model {requested!r} does not exist: this server serves {served}; set model to one of them",
            HTTPStatus.NOT_FOUND,
            param="model",
        )

    def check_extra_fields(self, request: OpenAIBaseModel, misplaced: dict[str, str], route: str) -> None:
        """Refuse fields of another route; log (and ignore) other unknown fields, as vLLM does."""
        extra = request.model_extra or {}
        for name in extra:
            if name in misplaced:
                raise APIError(f"{name} is not a field of {route}: {misplaced[name]}", param=name)
        if extra:
            logger.warning("%s: ignoring unknown field(s) %s", route, ", ".join(sorted(extra)))

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def render_chat(
        self, request: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool
    ) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids. Rendering and tokenizing run in a worker thread, so a
        huge history never holds up the event loop (and the streams it serves)."""
        if request.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(
                "this request sends its own chat_template, which the server does not run unless started "
                "with --trust-request-chat-template: drop chat_template or restart the server with that flag",
                param="chat_template",
            )

        def render_and_tokenize() -> tuple[str, list[int]]:
            text = self.renderer.render(
                request.messages or [],
                tools=request.tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                request_template=request.chat_template,
                template_kwargs=request.chat_template_kwargs,
            )
            return text, self.tokenize(text, add_special_tokens)

        return await asyncio.to_thread(render_and_tokenize)

    def check_prompt_ids(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise APIError(f"{param} is empty (0 tokens): send at least one token of text", param=param)
        vocab_size = self.engine.config.model.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                f"{param} holds token id {bad}, outside the vocabulary [0, {vocab_size}): "
                "send ids this model's tokenizer produced",
                param=param,
            )
        if len(prompt_ids) >= self.max_model_len:
            raise APIError(
                f"{param} has {len(prompt_ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt + output): shorten it to at most "
                f"{self.max_model_len - 1} tokens, or restart the server with a larger --max-model-len",
                param=param,
            )

    def resolve_max_tokens(self, requested: int | None, field: str, prompt_len: int) -> int:
        """The request's limit, or what the context leaves (capped by generation_config's max_tokens)."""
        room = self.max_model_len - prompt_len
        if requested is None:
            default = self.generation_defaults.get("max_tokens")
            return min(room, default) if default else room
        if requested > room:
            raise APIError(
                f"{field}={requested} is more than the context leaves: this model's maximum context length "
                f"is {self.max_model_len} tokens and the prompt has {prompt_len}, so at most {room} can be "
                f"generated; set {field} to {room} or less, or shorten the prompt",
                param=field,
            )
        return requested

    def check_common(self, request: SamplingRequest) -> int:
        """Checks shared by chat and completions; returns n."""
        n = 1 if request.n is None else request.n
        if n > self.max_num_seqs:
            raise APIError(
                f"n={n} is above the limit {self.max_num_seqs} (the server's --max-num-seqs): ask for "
                f"{self.max_num_seqs} or fewer choices, or restart the server with a larger --max-num-seqs",
                param="n",
            )
        if request.best_of is not None and request.best_of != n:
            raise APIError(
                f"best_of={request.best_of} differs from n={n}: fitserve returns every sample; "
                "leave best_of out or set it equal to n",
                param="best_of",
            )
        if request.use_beam_search:
            raise APIError("use_beam_search is not supported: leave it out", param="use_beam_search")
        if request.logit_bias:
            raise APIError("logit_bias is not supported yet: leave it out", param="logit_bias")
        if request.stream_options is not None and not request.stream:
            raise APIError(
                "stream_options is only allowed with stream=true: set stream to true or drop stream_options",
                param="stream_options",
            )
        return n

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        n: int,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        values: dict[str, Any] = {
            "n": n,
            "presence_penalty": request.presence_penalty,
            "frequency_penalty": request.frequency_penalty,
            "seed": request.seed,
            "stop": request.stop,
            "stop_token_ids": request.stop_token_ids,
            "ignore_eos": request.ignore_eos,
            "max_tokens": max_tokens,
            "min_tokens": request.min_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": request.skip_special_tokens,
            "spaces_between_special_tokens": request.spaces_between_special_tokens,
            "include_stop_str_in_output": request.include_stop_str_in_output,
        }
        for name in _MODEL_DEFAULT_FIELDS:
            requested = getattr(request, name)
            values[name] = requested if requested is not None else self.generation_defaults.get(name)
        try:
            return SamplingParams.from_optional(**values)
        except ValueError as exc:
            raise APIError(str(exc), param=_field_named_in(str(exc), values)) from exc

    def check_logprobs(self, value: int | None, field: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(
                f"{field}={value} is outside the range [0, {MAX_LOGPROBS}]: set {field} between 0 and "
                f"{MAX_LOGPROBS}",
                param=field,
            )


def _field_named_in(message: str, values: dict[str, Any]) -> str | None:
    head = message.split("=", 1)[0].split(" ", 1)[0]
    return head if head in values else None
