"""Engine log-probabilities in OpenAI's two shapes: chat (`logprobs.content[]`) and completions
(`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`).

JSON has no -inf: a log-probability is clamped to -9999.0, as vLLM does.

The server's engine leaves the entries' `decoded_token` empty (decoding on the engine thread stalls every
stream); these functions decode here, each distinct token id once per call.
"""

from __future__ import annotations

from typing import Any

from fitserve.core.outputs import Logprob, PositionLogprobs
from fitserve.engine.detokenizer import decode_token
from fitserve.server.responses import ChatLogprobEntry, ChatTopLogprob, CompletionLogprobs

LOGPROB_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class TokenTexts:
    """Token id -> text (special tokens included), each id decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int, entry: Logprob | None = None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = decode_token(self.tokenizer, token_id)
        return text


class TokenIdTexts:
    """vLLM's return_tokens_as_token_ids: a token is named "token_id:N", whatever its text."""

    def __call__(self, token_id: int, entry: Logprob | None = None) -> str:
        return f"token_id:{token_id}"


def prompt_logprobs_with_text(
    tokenizer: Any, positions: list[PositionLogprobs | None]
) -> list[PositionLogprobs | None]:
    """vLLM's `prompt_logprobs` (one {token id: Logprob} per prompt position, None for the first) with
    every `decoded_token` filled in."""
    texts = TokenTexts(tokenizer)
    return [
        None
        if position is None
        else {tid: Logprob(lp.logprob, lp.rank, texts(tid, lp)) for tid, lp in position.items()}
        for position in positions
    ]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprob_entries(
    tokenizer: Any,
    token_ids: list[int],
    positions: list[PositionLogprobs],
    num_top: int,
    as_token_ids: bool = False,
) -> list[ChatLogprobEntry]:
    """One entry per generated token; `top_logprobs` holds the num_top most likely tokens by rank.
    as_token_ids: name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    entries: list[ChatLogprobEntry] = []
    token_text = TokenIdTexts() if as_token_ids else TokenTexts(tokenizer)
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        text = token_text(token_id, chosen)
        ranked = sorted(
            ((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda item: item[1].rank or 0,
        )[:num_top]
        top = [
            ChatTopLogprob(token=(t := token_text(tid, lp)), logprob=_clamp(lp.logprob), bytes=_utf8(t))
            for tid, lp in ranked
        ]
        logprob = _clamp(chosen.logprob) if chosen is not None else LOGPROB_FLOOR
        entries.append(ChatLogprobEntry(token=text, logprob=logprob, bytes=_utf8(text), top_logprobs=top))
    return entries


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    initial_text_offset: int,
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """`top_logprobs` holds every entry the engine returned (the sampled token plus the top-k), as
    OpenAI's legacy completions do; a position without entries (the first prompt token) is null.
    as_token_ids: name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    result = CompletionLogprobs()
    offset = initial_text_offset
    token_text = TokenIdTexts() if as_token_ids else TokenTexts(tokenizer)
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position is not None else None
        text = token_text(token_id, chosen)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_clamp(chosen.logprob) if chosen is not None else LOGPROB_FLOOR)
        result.top_logprobs.append({token_text(tid, lp): _clamp(lp.logprob) for tid, lp in position.items()})
    return result


def join_completion_logprobs(
    first: CompletionLogprobs | None, second: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    """The two parts one after the other (echoed prompt, then output); either may be None."""
    if first is None or second is None:
        return first or second
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )
