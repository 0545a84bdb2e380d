"""Per-request sampling parameters, with vLLM's names, defaults and meanings.

A `SamplingParams` is checked once, in `__post_init__`: a bad value raises `ValueError` whose message
names the field, the value, the allowed range and how to fix it, so nothing invalid reaches the step
loop. After construction the object is treated as read-only by the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

# vLLM's structured-output parameters, importable from here as from vllm.sampling_params
from fitserve.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]

# Temperatures below this are greedy decoding (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
PENALTY_LIMIT = 2.0
# A seed is a 64-bit signed integer, as in vLLM. The choices of an n > 1 request are seeded seed + index,
# which stays within what torch's generators take ([-2**63, 2**64-1]) for any n the server allows.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """When the engine reports a request: every step with everything so far, or once when finished."""

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """What to sample and when to stop; field names and defaults follow vLLM's `SamplingParams`.

    n: completions to return for the prompt.
    presence_penalty / frequency_penalty: subtracted from the logit of every token already in the
        output, once (presence) or once per occurrence (frequency); range [-2, 2], 0 = off.
    repetition_penalty: for every token in the prompt or the output, a positive logit is divided by it
        and a negative one multiplied (HF/CTRL style); 1 = off, must be > 0.
    temperature: 0 (anything below 1e-5) = greedy argmax; otherwise logits are divided by it.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p; (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 = off (-1 is stored as 0).
    min_p: drop tokens whose probability is below min_p times the most likely token's; [0, 1].
    seed: a per-request random seed: the request's samples then do not depend on the rest of the batch.
    stop: strings that end generation; the output is cut before the stop string (stored as a list).
    stop_token_ids: token ids that end generation (the token stays in token_ids).
    ignore_eos: keep generating after the end-of-sequence token.
    max_tokens: most tokens to generate; None = until the model's context is full.
    min_tokens: eos and stop_token_ids cannot be sampled before this many tokens were generated.
    logprobs: return this many top log-probabilities per generated token (plus the sampled one).
    prompt_logprobs: the same for every prompt token after the first.
    detokenize: produce text (False: token ids only; stop strings need text).
    skip_special_tokens / spaces_between_special_tokens: how special tokens appear in the text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    logit_bias: {token id: bias} added to the logits before penalties and sampling (stored with int keys).
    allowed_token_ids: only these token ids may be sampled (every other logit becomes -inf); not empty.
    bad_words: words never to generate: each word's tokens (as the tokenizer writes it alone and after a
        space) are banned, the last one whenever the output ends with the others (vLLM's rule);
        the engine turns them into token ids (update_from_tokenizer).
    output_kind: CUMULATIVE (a RequestOutput every step, for streaming) or FINAL_ONLY (the offline API).
    structured_outputs: hold the output to a JSON schema, a JSON object, a regex, a choice or a grammar
        (a `StructuredOutputsParams`, or a dict of its fields; docs/structured_outputs.md).
    guided_decoding: vLLM's older name for structured_outputs (moved there; set one of them).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Any = None
    guided_decoding: Any = None

    def __post_init__(self) -> None:
        self.structured_outputs = _normalise_structured_outputs(self.structured_outputs, self.guided_decoding)
        self.guided_decoding = None
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        _check_int("n", self.n, minimum=1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(
                    f"{name}={value} is outside the range [-2, 2]: set {name} between -2 and 2 (0 = off)"
                )
        repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty={repetition_penalty} must be greater than 0: set repetition_penalty "
                "above 0 (1 = off, above 1 discourages repetition)"
            )
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(
                f"temperature={temperature} is below the minimum 0: set temperature to 0 (greedy) or more"
            )
        top_p = _check_float("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} is outside the range (0, 1]: set top_p above 0 and at most 1")
        _check_int("top_k", self.top_k, minimum=None)
        if self.top_k < -1:
            raise ValueError(
                f"top_k={self.top_k} is below the minimum -1: set top_k to 0 or -1 (off) or to a "
                "positive number of tokens"
            )
        if self.top_k == -1:
            self.top_k = 0
        min_p = _check_float("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p={min_p} is outside the range [0, 1]: set min_p between 0 (off) and 1")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=None)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(
                    f"seed={self.seed} is outside the range [-2**63, 2**63-1] ([{SEED_MIN}, {SEED_MAX}]): "
                    "set seed to a 64-bit signed integer"
                )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} is above max_tokens={self.max_tokens}: set min_tokens to at "
                f"most {self.max_tokens} or raise max_tokens"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        # bad_words as token-id sequences: set by update_from_tokenizer (the engine, on add_request)
        self.bad_words_token_ids: list[list[int]] = []
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop={self.stop!r} needs text but detokenize=False: set detokenize=True or use "
                "stop_token_ids instead of stop strings"
            )

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Builds params from keyword arguments, leaving out the ones that are None (default kept)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}: use only these names: {', '.join(sorted(known))}"
            )
        return cls(**{name: value for name, value in kwargs.items() if value is not None})

    def clone(self) -> SamplingParams:
        """A copy whose lists can be changed without touching this one."""
        return copy.deepcopy(self)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError naming the field when logit_bias or allowed_token_ids holds an id outside
        the vocabulary [0, vocab_size)."""
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids)):
            bad = next((t for t in ids or () if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size}): use ids this "
                    "model's tokenizer produces"
                )

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Turns bad_words into the token-id sequences the sampler bans: each word as the tokenizer
        writes it at the start of a text, and after a space when that spelling is another token
        sequence of the same length (a word in the middle of a sentence)."""
        sequences: list[list[int]] = []
        for word in self.bad_words or ():
            alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (alone, spaced):
                if ids and ids not in sequences and (ids is alone or len(ids) == len(alone)):
                    sequences.append(ids)
        self.bad_words_token_ids = sequences

    @property
    def max_stop_str_len(self) -> int:
        """Length in characters of the longest stop string (0 when there is none)."""
        return max((len(s) for s in self.stop), default=0)


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(
            f"stop={stop!r} has type {type(stop).__name__}: set stop to a string or a list of strings"
        )
    for item in stop:
        if not isinstance(item, str):
            raise ValueError(
                f"stop contains {item!r} of type {type(item).__name__}: every stop entry must be a string "
                "(use stop_token_ids for token ids)"
            )
        if not item:
            raise ValueError("stop contains an empty string '': remove it (an empty stop would end at once)")
    return list(stop)


def _normalise_stop_token_ids(stop_token_ids: object) -> list[int]:
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, int) and not isinstance(stop_token_ids, bool):
        stop_token_ids = [stop_token_ids]
    if not isinstance(stop_token_ids, (list, tuple)):
        raise ValueError(
            f"stop_token_ids={stop_token_ids!r} has type {type(stop_token_ids).__name__}: "
            "set stop_token_ids to a list of token ids"
        )
    for item in stop_token_ids:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ValueError(
                f"stop_token_ids contains {item!r}: every entry must be a token id, an integer 0 or more"
            )
    return list(stop_token_ids)


def _normalise_logit_bias(logit_bias: object) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(
            f"logit_bias={logit_bias!r} has type {type(logit_bias).__name__}: set logit_bias to a dict "
            "{token id: bias}"
        )
    normalised: dict[int, float] = {}
    for token, bias in logit_bias.items():
        token_id = token
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token_id = int(token)
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(
                f"logit_bias has the key {token!r}: every key must be a token id, an integer 0 or more"
            )
        normalised[token_id] = _check_float(f"logit_bias[{token_id}]", bias)
    return normalised or None


def _normalise_allowed_token_ids(allowed: object) -> list[int] | None:
    if allowed is None:
        return None
    if not isinstance(allowed, (list, tuple, set, frozenset)):
        raise ValueError(
            f"allowed_token_ids={allowed!r} has type {type(allowed).__name__}: set allowed_token_ids to a "
            "list of token ids"
        )
    if not allowed:
        raise ValueError(
            "allowed_token_ids is empty: list at least one token id that may be sampled, or leave it out"
        )
    for item in allowed:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ValueError(
                f"allowed_token_ids contains {item!r}: every entry must be a token id, an integer 0 or more"
            )
    return sorted(set(allowed))


def _normalise_structured_outputs(structured: object, guided: object) -> Any:
    """A StructuredOutputsParams (from itself or a dict of its fields), or None."""
    if structured is not None and guided is not None:
        raise ValueError(
            "structured_outputs and guided_decoding are both set: they are the same setting under two "
            "names; keep structured_outputs"
        )
    value = structured if structured is not None else guided
    name = "structured_outputs" if structured is not None else "guided_decoding"
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"{name}={value!r:.80} has type {type(value).__name__}: pass a StructuredOutputsParams or a dict "
            "with one of json, json_object, regex, choice or grammar"
        )
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}: use only {', '.join(sorted(known))}")
    return StructuredOutputsParams(**value)


def _normalise_bad_words(bad_words: object) -> list[str] | None:
    if bad_words is None:
        return None
    if isinstance(bad_words, str):
        bad_words = [bad_words]
    if not isinstance(bad_words, (list, tuple)):
        raise ValueError(
            f"bad_words={bad_words!r} has type {type(bad_words).__name__}: set bad_words to a list of strings"
        )
    for word in bad_words:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(
                f"bad_words contains {word!r}: every entry must be a word (a string with a character other "
                "than whitespace)"
            )
    return list(bad_words) or None


def _check_int(name: str, value: object, minimum: int | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not an integer: set {name} to a whole number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} is below the minimum {minimum}: set {name} to {minimum} or more")
    return value


def _check_float(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a number: set {name} to a number")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} is not a finite number: set {name} to a finite number")
    return float(value)
