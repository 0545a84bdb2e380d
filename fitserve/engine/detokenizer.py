"""Incremental detokenization and stop-string matching for one sequence.

Fast path: when the tokenizer has a token byte table (fitserve/token_bytes.py: byte-level BPE
and sentencepiece-style decoders), each token's raw bytes go through an incremental UTF-8 decoder,
O(1) per token; bytes of an unfinished character are held back (at most 3). The text equals
`tokenizer.decode` of the output ids (after `finish`), except for the documented byte-fallback case
in token_bytes.py. The prompt's last PROMPT_CONTEXT_TOKENS tokens are fed first and their text
dropped, so a decoder that strips the start of the text (sentencepiece) strips it only where the whole
text starts, as the window path does.

Window path (any other tokenizer, or spaces_between_special_tokens=False): text is produced by
decoding a short window of token ids and subtracting the decode of the window's first part (the
"prefix"), so each new token costs O(window), not O(output):

    window = ids[prefix_offset:]            (kept as the list `_window`)
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text = decode(window)               -> the new characters are new_text[len(prefix_text):]

Decoding from a token before the new ones keeps the context that some tokenizers need (sentencepiece
drops the leading space of the first token of a decode). While the decoded text ends in U+FFFD, the
last tokens hold only part of a multi-byte UTF-8 character (byte-level BPE splits Chinese and emoji
across tokens), so nothing is emitted until the character is complete. After MAX_PENDING_TOKENS tokens
without progress the window is flushed anyway (invalid bytes then show as U+FFFD), which bounds the
window.

Stop strings are matched on the full output text, across token boundaries. The stop match that ends
first wins (at the same end, the one that starts first); the text is cut before it, or after it when
include_stop_str_in_output.
"""

from __future__ import annotations

from typing import Any

from fitserve.core.sampling_params import SamplingParams
from fitserve.token_bytes import TokenByteStream, token_byte_table

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first output token, for leading-space context.
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 tokens; a window that has not produced text after this many new
# tokens is flushed as it is.
MAX_PENDING_TOKENS = 8


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own, special tokens included (for logprob entries). A token that
    holds part of a UTF-8 character decodes to U+FFFD."""
    table = token_byte_table(tokenizer, check_added_tokens=False)
    if table is not None and token_id < len(table.bytes_by_id):
        return table.token_text(token_id)
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        use_byte_table: bool = True,
    ) -> None:
        """`use_byte_table=False` forces the window path (for comparisons and benchmarks)."""
        self._tokenizer = tokenizer
        self._params = params
        self._stop_strings: list[str] = list(params.stop or [])
        self._max_stop_len = params.max_stop_str_len
        # A new match ends in the new text, so its last character is there; None: search every time.
        self._stop_last_chars: frozenset[str] | None = (
            frozenset(stop[-1] for stop in self._stop_strings) if all(self._stop_strings) else None
        )
        self._byte_stream: TokenByteStream | None = None
        fast = use_byte_table and params.detokenize and params.spaces_between_special_tokens
        table = token_byte_table(tokenizer) if fast else None
        if table is not None:
            self._byte_stream = TokenByteStream(table, params.skip_special_tokens)
            self._byte_stream.decode(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if prompt_token_ids else [])
            self._byte_stream.drop_unfinished_character()
        # Invariant: _window == all_ids[prefix_offset:], _read == read_offset - prefix_offset.
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._read = len(self._window)
        self._prefix_text: str | None = None  # decode(_window[:_read]), computed on first use
        self._added_token_ids: frozenset[int] | None = None
        if not params.spaces_between_special_tokens:
            self._added_token_ids = _added_token_ids(tokenizer)
        self._output_text = ""
        self._stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far; a matched stop string is cut off unless include_stop_str_in_output."""
        return self._output_text

    @property
    def uses_byte_table(self) -> bool:
        """True on the fast path (a token byte table), False on the window path."""
        return self._byte_stream is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_reason

    def add_tokens(self, new_ids: list[int]) -> str | None:
        """Appends generated tokens; returns the stop string they completed, or None.

        After a stop string matched, the text is final and no more tokens may be added.
        """
        if self._stop_reason is not None:
            raise RuntimeError(
                f"tokens {new_ids} were added after the stop string {self._stop_reason!r} ended the text: "
                "finish the sequence when add_tokens returns a stop string"
            )
        if not self._params.detokenize or not new_ids:
            return None
        if self._byte_stream is not None:
            return self._append(self._byte_stream.decode(new_ids))
        return self._append("".join([self._decode_next(token_id) for token_id in new_ids]))

    def finish(self) -> str | None:
        """Ends the text when the sequence ends without a stop string (length, EOS, stop token): text
        still held back for an unfinished UTF-8 character is added as `decode` shows it (U+FFFD), so
        the text equals `tokenizer.decode` of all output ids. Returns the stop string that the added
        text completed, or None. Calling it again adds nothing."""
        if self._stop_reason is not None or not self._params.detokenize:
            return None
        if self._byte_stream is not None:
            return self._append(self._byte_stream.flush())
        if len(self._window) == self._read:
            return None
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        rest = self._decode(self._window)[len(self._prefix_text) :]
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = None
        return self._append(rest)

    def stream_text(self, finished: bool) -> str:
        """The text that is safe to show now. While not finished it leaves out the last
        (longest stop string - 1) characters, which could still turn into a stop string; the result
        only grows from call to call."""
        if finished or self._stop_reason is not None or self._max_stop_len <= 1:
            return self._output_text
        return self._output_text[: max(0, len(self._output_text) - (self._max_stop_len - 1))]

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        new_text = self._decode(self._window)
        pending = len(self._window) - self._read
        complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if not complete and pending < MAX_PENDING_TOKENS:
            return ""
        delta = new_text[len(self._prefix_text) :]
        # The emitted tokens become the next prefix; older tokens leave the window.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = None
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        skip = self._params.skip_special_tokens
        if self._added_token_ids is None or not self._added_token_ids.intersection(token_ids):
            return self._tokenizer.decode(token_ids, skip_special_tokens=skip)
        # spaces_between_special_tokens=False: each added token and each run of ordinary tokens is
        # decoded on its own and the pieces are joined with nothing between them.
        pieces: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            if token_id in self._added_token_ids:
                if run:
                    pieces.append(self._tokenizer.decode(run, skip_special_tokens=skip))
                    run = []
                pieces.append(self._tokenizer.decode([token_id], skip_special_tokens=skip))
            else:
                run.append(token_id)
        if run:
            pieces.append(self._tokenizer.decode(run, skip_special_tokens=skip))
        return "".join(pieces)

    def _append(self, new_text: str) -> str | None:
        """Adds text to the output; returns the stop string that ends in it (the text is then cut)."""
        if new_text:
            checked_len = len(self._output_text)
            self._output_text += new_text
            last_chars = self._stop_last_chars
            if self._stop_strings and (last_chars is None or not last_chars.isdisjoint(new_text)):
                self._stop_reason = self._find_stop(checked_len)
        return self._stop_reason

    def _find_stop(self, checked_len: int) -> str | None:
        """Searches the text added after `checked_len` chars for a stop string; cuts the text on a match."""
        text = self._output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop_strings:
            start = text.find(stop, max(0, checked_len - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        self._output_text = text[:end] if self._params.include_stop_str_in_output else text[:start]
        return stop


def _added_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's added tokens, special or not."""
    return frozenset(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
