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
from fitserve.engine.beam_search import BeamSearchParams, BeamSearchStream, check_beam_width
from fitserve.engine.request_stream import RequestStream
from fitserve.server.args import ServerSettings
from fitserve.server.chat import ChatRenderer
from fitserve.server.errors import APIError
from fitserve.server.protocol import ChatCompletionRequest, OpenAIBaseModel, SamplingRequest, TokenizeRequest
from fitserve.structured.backend import validate as validate_structured
from fitserve.structured.params import StructuredOutputsParams, check_backend

logger = logging.getLogger(__name__)

# Characters a prompt's text may have per token of --max-model-len before it is refused untokenized.
# English averages about 4 characters a token and long runs of spaces or punctuation make single tokens
# of up to 16 or so, so a text above this is far beyond what the context holds; tokenizing it would cost
# about 75-100 MiB of memory per MB of text for nothing (docs/server.md, "Limits").
MAX_PROMPT_CHARS_PER_TOKEN = 32
# Most prompts (a list of strings or of token-id lists) one /v1/completions request may send.
MAX_PROMPTS_PER_REQUEST = 1024
# OpenAI's range of a logit_bias value.
LOGIT_BIAS_LIMIT = 100.0
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
        check_no_structural_tag(extra)
        for name in extra:
            if name in misplaced:
                raise APIError(f"{name} is not a field of {route}: {misplaced[name]}", param=name)
        if extra:
            logger.warning("%s: ignoring unknown field(s) %s", route, ", ".join(sorted(extra)))

    def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self.check_prompt_text(text, param)
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
            return text, self.tokenize(text, add_special_tokens, "messages")

        return await asyncio.to_thread(render_and_tokenize)

    def decode_prompt_ids(self, prompt_ids: list[int], param: str) -> str:
        """The text of a token-id prompt (for echo), its ids checked against the vocabulary first."""
        self.check_vocabulary(prompt_ids, param)
        return self.tokenizer.decode(prompt_ids)

    def check_vocabulary(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.engine.config.model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise APIError(
                f"{param} holds token id {bad}, outside the vocabulary [0, {vocab_size}): "
                "send ids this model's tokenizer produced",
                param=param,
            )

    def check_prompt_ids(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise APIError(f"{param} is empty (0 tokens): send at least one token of text", param=param)
        self.check_vocabulary(prompt_ids, param)
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
            check_beam_search_fields(request, n, self.engine.config.model.vocab_size)
        elif request.length_penalty is not None and request.length_penalty != 1.0:
            raise APIError(
                f"length_penalty={request.length_penalty} applies only to beam search: set use_beam_search "
                "to true, or drop length_penalty",
                param="length_penalty",
            )
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
        tool_structured: dict[str, Any] | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """The request's SamplingParams, or its BeamSearchParams when it asks for use_beam_search (n beams,
        as in vLLM; check_common has refused the fields beam search would not honour). tool_structured: the
        structured output the chat route's tool_choice asks for (required / a named function)."""
        structured = structured_outputs_params(request, tool_structured)
        if structured is not None and request.use_beam_search:
            raise APIError(
                "structured outputs (response_format, structured_outputs, guided_*) do not work with beam "
                "search: set use_beam_search to false, or drop the constraint",
                param="use_beam_search",
            )
        if request.use_beam_search:
            return BeamSearchParams(
                beam_width=n,
                max_tokens=max_tokens,
                ignore_eos=bool(request.ignore_eos),
                temperature=request.temperature or 0.0,
                length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
                include_stop_str_in_output=bool(request.include_stop_str_in_output),
            )
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
            "logit_bias": _clamped_logit_bias(request.logit_bias),
            "allowed_token_ids": request.allowed_token_ids,
            "bad_words": request.bad_words,
            "structured_outputs": structured,
        }
        for name in _MODEL_DEFAULT_FIELDS:
            requested = getattr(request, name)
            values[name] = requested if requested is not None else self.generation_defaults.get(name)
        try:
            params = SamplingParams.from_optional(**values)
            params.check_token_ids(self.engine.config.model.vocab_size)
        except ValueError as exc:
            raise APIError(str(exc), param=_field_named_in(str(exc), values)) from exc
        if structured is not None:
            check_structured_outputs(
                structured,
                _structured_field(request, tool_structured),
                max_tokens=max_tokens,
                tokenizer=self.tokenizer,
                **_output_limit_wording(request, max_tokens),
            )
        return params

    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | BeamSearchParams,
    ) -> RequestStream | BeamSearchStream:
        """Starts the request on the engine; a beam search runs as a BeamSearchStream (one final output)."""
        if isinstance(params, BeamSearchParams):
            return BeamSearchStream(self.engine, request_id, prompt, prompt_token_ids, params)
        return await self.engine.add_request(request_id, prompt, prompt_token_ids, params)

    @property
    def max_logprobs(self) -> int:
        """--max-logprobs; -1 (no limit) reads as the vocabulary size."""
        model_config = self.engine.config.model
        limit = getattr(model_config, "max_logprobs", 20)
        return model_config.vocab_size if limit == -1 else limit

    def tokens_as_token_ids(self, request: SamplingRequest) -> bool:
        """vLLM's return_tokens_as_token_ids: the request's field, else --return-tokens-as-token-ids."""
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.settings.return_tokens_as_token_ids

    def check_logprobs(self, value: int | None, field: str) -> None:
        if value is None:
            return
        if value < 0:
            raise APIError(f"{field}={value} is negative: set {field} to 0 or more", param=field)
        limit = self.max_logprobs
        if value > limit:
            raise APIError(
                f"{field}={value} is above the server's limit of {limit} log-probabilities per token "
                f"(--max-logprobs): ask for {limit} or fewer, or restart the server with a larger "
                "--max-logprobs",
                param=field,
            )

    def check_prompt_text(self, text: str, param: str) -> None:
        """Refuses, before tokenizing, text far longer than the context could hold."""
        limit = self.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        if len(text) > limit:
            raise APIError(
                f"{param} has {len(text)} characters, above the limit of {limit} ({self.max_model_len} "
                f"tokens of --max-model-len x {MAX_PROMPT_CHARS_PER_TOKEN} characters per token), far more "
                f"than this model's context holds: shorten it to fit {self.max_model_len - 1} tokens",
                param=param,
            )
        check_unicode(text, param)

    def check_prompt_count(self, count: int, param: str) -> None:
        if count > MAX_PROMPTS_PER_REQUEST:
            raise APIError(
                f"{param} holds {count} prompts, above the limit of {MAX_PROMPTS_PER_REQUEST} per request: "
                f"send them in requests of at most {MAX_PROMPTS_PER_REQUEST} prompts",
                param=param,
            )


def _clamped_logit_bias(logit_bias: dict[str, float] | None) -> dict[Any, float] | None:
    """OpenAI's logit_bias (token id strings to a bias in [-100, 100]); a bias outside the range is
    clamped to it, as vLLM does. Keys are checked by SamplingParams (a non-integer key is a 400)."""
    if not logit_bias:
        return None
    return {token: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias)) for token, bias in logit_bias.items()}


def _field_named_in(message: str, values: dict[str, Any]) -> str | None:
    head = message.split("=", 1)[0].split(" ", 1)[0]
    return head if head in values else None


def check_unicode(text: str, param: str) -> None:
    """Refuses text that is not valid Unicode: JSON lets a string hold a lone UTF-16 surrogate
    ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise APIError(
            f"{param} holds a lone UTF-16 surrogate (\\u{ord(bad):04x} at character {error.start}), which is "
            "not valid Unicode: send text whose surrogates come in pairs, or the character itself",
            param=param,
        ) from None


# vLLM's older request fields for structured outputs -> StructuredOutputsParams' field.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def check_no_structural_tag(extra: dict[str, Any]) -> None:
    """vLLM's structural_tag (tags around JSON sections) is refused, never answered with free text."""
    if extra.get("structural_tag") is not None:
        raise APIError(
            "structural_tag is not supported by fitserve: ask for structured_outputs json, regex, choice or "
            "grammar (or response_format), or leave structural_tag out",
            param="structural_tag",
        )


def structured_outputs_params(
    request: SamplingRequest, tool_structured: dict[str, Any] | None = None
) -> StructuredOutputsParams | None:
    """What the request's response_format, structured_outputs and guided_* fields ask for, as one
    StructuredOutputsParams; a 400 naming the fields when more than one constraint is asked for, or a
    value is malformed. tool_structured: what the chat route's tool_choice required / named asks for."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if tool_structured is not None:
        asked.append(("tool_choice", tool_structured))
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise APIError(
                'response_format of type "json_schema" needs json_schema.schema: send {"type": '
                '"json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
        asked.append(("response_format", {"json": spec.json_schema}))
    if request.structured_outputs is not None:
        asked.append(("structured_outputs", dict(request.structured_outputs)))
    for field_name, key in GUIDED_FIELDS.items():
        value = getattr(request, field_name)
        if value is not None:
            asked.append((field_name, {key: value}))
    if not asked:
        if request.guided_decoding_backend is not None or request.guided_whitespace_pattern is not None:
            _check_options(request, {})
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(
            f"this request asks for {len(asked)} output constraints ({names}), but one request takes one: "
            "keep exactly one of them",
            param=asked[1][0],
        )
    name, values = asked[0]
    values = _check_options(request, values)
    try:
        return StructuredOutputsParams(**values)
    except (TypeError, ValueError) as exc:
        raise APIError(f"{name}: {exc}", param=name) from None


def _check_options(request: SamplingRequest, values: dict[str, Any]) -> dict[str, Any]:
    values = dict(values)
    if request.guided_decoding_backend is not None:
        values.setdefault("backend", request.guided_decoding_backend)
    if request.guided_whitespace_pattern is not None:
        values.setdefault("whitespace_pattern", request.guided_whitespace_pattern)
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise APIError(
            f"structured_outputs has unknown key(s) {unknown}: use only {', '.join(sorted(known))}",
            param="structured_outputs",
        )
    try:
        check_backend(values.get("backend"), "guided_decoding_backend")
        if values.get("whitespace_pattern") is not None:
            StructuredOutputsParams(json_object=True, whitespace_pattern=values["whitespace_pattern"])
    except ValueError as exc:
        raise APIError(str(exc), param="guided_decoding_backend") from None
    return values


def _structured_field(request: SamplingRequest, tool_structured: dict[str, Any] | None) -> str:
    if tool_structured is not None:
        return "tool_choice"
    if request.response_format is not None and request.response_format.type != "text":
        return "response_format"
    if request.structured_outputs is not None:
        return "structured_outputs"
    return next((name for name in GUIDED_FIELDS if getattr(request, name) is not None), "structured_outputs")


def check_structured_outputs(
    structured: StructuredOutputsParams,
    field_name: str,
    max_tokens: int | None = None,
    tokenizer: Any = None,
    limit: str | None = None,
    fix: str | None = None,
) -> None:
    """Builds the request's grammar once (no decoding): an invalid schema, regex or grammar, or a schema
    feature the backend cannot enforce, is a 400 naming the reason; so is a grammar whose every complete
    output takes more than max_tokens tokens (with the tokenizer; fitserve/structured/min_tokens.py)."""
    try:
        validate_structured(structured, max_tokens, tokenizer, limit, fix)
    except ValueError as exc:
        raise APIError(f"{field_name}: {exc}", param=field_name) from None


def _output_limit_wording(request: SamplingRequest, max_tokens: int) -> dict[str, str | None]:
    """How a too-small output limit is named: the field the request set (chat's max_completion_tokens or
    max_tokens), or, when it set none, what the context and the model's default leave."""
    if getattr(request, "max_completion_tokens", None) is not None:
        return {
            "limit": f"max_completion_tokens is {max_tokens}",
            "fix": "raise max_completion_tokens to at least {needed}",
        }
    if getattr(request, "max_tokens", None) is not None:
        return {"limit": None, "fix": None}
    return {
        "limit": f"max_tokens is not set, which leaves this request {max_tokens} tokens (what the context "
        "holds after the prompt, or the model's default limit)",
        "fix": "set max_tokens to at least {needed}, shortening the prompt or raising --max-model-len if the "
        "context leaves less",
    }


# Sampling fields beam search does not use, with the value that means "off" (vLLM ignores them there; a
# request that sets one is refused rather than answered as if it had not).
_NOT_FOR_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "top_p": (1, 1.0),
    "top_k": (0, -1),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "seed": (),
    "stop": ([], ""),
    "stop_token_ids": ([],),
    "logit_bias": ({},),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "prompt_logprobs": (),
    "top_logprobs": (0,),
}


def check_beam_search_fields(request: SamplingRequest, n: int, vocab_size: int) -> None:
    """use_beam_search: n (the beam width) must fit the vocabulary, and the fields beam search would not
    honour (sampling filters, penalties, stop strings, logprobs) must be left out."""
    if n < 1:
        raise APIError(
            f"n={n} is below 1: with use_beam_search, n is the beam width; set n to 1 or more", param="n"
        )
    try:
        check_beam_width(n, vocab_size)
    except ValueError as exc:
        raise APIError(str(exc).replace("beam_width=", "n (the beam width)=", 1), param="n") from exc
    for name, off_values in _NOT_FOR_BEAM_SEARCH.items():
        value = getattr(request, name, None)
        if value is not None and value not in off_values:
            raise APIError(
                f"{name}={value!r} is not used by beam search: drop {name}, or set use_beam_search to false "
                "to sample with it",
                param=name,
            )
    logprobs = getattr(request, "logprobs", None)
    if logprobs is not None and logprobs is not False:
        raise APIError(
            f"logprobs={logprobs!r} is not available with beam search: drop logprobs, or set use_beam_search "
            "to false",
            param="logprobs",
        )
