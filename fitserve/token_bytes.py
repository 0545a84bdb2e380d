"""Token id -> raw bytes tables, for tokenizers whose decode is a plain concatenation of bytes.

With such a table, incremental detokenization is O(1) per token: look up the token's bytes and feed
them to an incremental UTF-8 decoder, which holds back the bytes of an unfinished character.

Eligible tokenizers are `transformers` tokenizers backed by `tokenizers` whose decode is the stock
one (no subclass override, no clean-up that changes text) with one of these decoders:

- ByteLevel (GPT-2 style: Llama 3, Qwen2/3, SmolLM2): a token's stand-in characters map back to
  bytes; the start of the text is kept.
- Sequence[Replace('▁', ' '), ByteFallback?, Fuse?, Strip(' ', n, 0)?] (Llama 2, Mistral, Gemma):
  '▁' -> ' ', `<0xNN>` -> that byte; up to n leading spaces of the whole text are stripped.

Other decoders (WordPiece, BPEDecoder, CTC, Metaspace: encoder models such as T5 and XLM-R) have no
table.

Skipped special tokens are the backend's added tokens marked special (what `decode` skips); added
tokens are decoded through the same rules as vocabulary tokens, as the backend does. Ids outside the
vocabulary decode to nothing. Invalid UTF-8 becomes U+FFFD: one per maximal invalid subsequence for
ByteLevel (as Rust's from_utf8_lossy), one per invalid byte for ByteFallback. A table is built once
per tokenizer object and checked against `tokenizer.decode` on a sample of the vocabulary and a
probe text before use; any doubt means no table (callers fall back to decoding windows).

Known difference: ByteFallback turns a whole run of adjacent `<0xNN>` tokens into U+FFFDs when any
part of the run is invalid, valid characters included. A stream cannot take back characters it
already emitted, so here only the invalid bytes become U+FFFD. Valid UTF-8 decodes identically.
"""

from __future__ import annotations

import codecs
import json
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("fitserve.detokenizer")

REPLACE_EACH_BYTE = "fitserve.replace_each_byte"
# Text whose decode shows whether clean_up_tokenization_spaces rewrites spaces before punctuation.
CLEANUP_PROBE_TEXT = "a , b . c ! d ? e ' f n't g 'm h 's i 've j 're k  l\n m"
SAMPLE_CHECK_SIZE = 4096


def _replace_each_byte(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):
        raise error
    return "\ufffd" * (error.end - error.start), error.end


codecs.register_error(REPLACE_EACH_BYTE, _replace_each_byte)


@dataclass
class TokenByteTable:
    """Raw bytes of every token id of one tokenizer. Invariant: decoding the concatenated bytes of a
    sequence (specials as `bytes_skipping_special` says, leading spaces per `strip_leading_spaces`)
    with `utf8_errors` equals `tokenizer.decode` of the sequence."""

    bytes_by_id: list[bytes]  # special tokens -> their content
    bytes_skipping_special: list[bytes]  # special tokens -> b""
    special_ids: frozenset[int]
    utf8_errors: str
    strip_leading_spaces: int = 0  # Strip decoder: up to this many spaces leave the start of the text

    def token_text(self, token_id: int) -> str:
        """`tokenizer.decode([token_id], skip_special_tokens=False)`."""
        data = self.bytes_by_id[token_id] if 0 <= token_id < len(self.bytes_by_id) else _outside(token_id)
        if self.strip_leading_spaces:
            data = data[: self.strip_leading_spaces].lstrip(b" ") + data[self.strip_leading_spaces :]
        return data.decode("utf-8", self.utf8_errors)


class TokenByteStream:
    """Incremental decode of one token sequence with a TokenByteTable: the text of each token as soon
    as its characters are complete; `flush` ends the text like `decode` does."""

    __slots__ = ("_bytes", "_size", "_errors", "_pending", "_spaces_to_strip")

    def __init__(self, table: TokenByteTable, skip_special_tokens: bool) -> None:
        self._bytes = table.bytes_skipping_special if skip_special_tokens else table.bytes_by_id
        self._size = len(self._bytes)
        self._errors = table.utf8_errors
        self._pending = b""  # the bytes of an unfinished character (at most 3)
        # Leading spaces still to strip; 0 once the text has a character that is not a space.
        self._spaces_to_strip = table.strip_leading_spaces

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text completed by these tokens (bytes of an unfinished character are kept back)."""
        pending = self._pending
        if self._spaces_to_strip:
            start_bytes, token_ids = self._strip_start(token_ids)
            pending += start_bytes
        table, size = self._bytes, self._size
        if len(token_ids) == 1:
            token_id = token_ids[0]
            data = table[token_id] if 0 <= token_id < size else _outside(token_id)
        else:
            data = b"".join([table[t] if 0 <= t < size else _outside(t) for t in token_ids])
        if pending:
            data = pending + data
        # The incremental UTF-8 decode of codecs.IncrementalDecoder, without its extra Python frame.
        text, used = codecs.utf_8_decode(data, self._errors, False)
        self._pending = data[used:]
        return text

    def flush(self) -> str:
        """Ends the text: kept-back bytes of an unfinished character become U+FFFD."""
        text, _ = codecs.utf_8_decode(self._pending, self._errors, True)
        self._pending = b""
        return text

    def drop_unfinished_character(self) -> None:
        """Forgets kept-back bytes (the start-of-text state stays)."""
        self._pending = b""

    def _strip_start(self, token_ids: Sequence[int]) -> tuple[bytes, Sequence[int]]:
        """Strips leading spaces from the first tokens: (what is left of the first token that has
        more than spaces, the ids after it); (b"", []) when all of them were spaces or skipped."""
        for index, token_id in enumerate(token_ids):
            data = self._bytes[token_id] if 0 <= token_id < self._size else _outside(token_id)
            spaces = min(len(data) - len(data.lstrip(b" ")), self._spaces_to_strip)
            self._spaces_to_strip = 0 if len(data) > spaces else self._spaces_to_strip - spaces
            if not self._spaces_to_strip:
                return data[spaces:], token_ids[index + 1 :]
        return b"", []


def _outside(token_id: int) -> bytes:
    """Bytes of an id outside the table: none, as `decode` drops unknown ids; negative ids are refused."""
    if token_id < 0:
        raise ValueError(f"token id {token_id} is negative: token ids are 0 or more")
    return b""


# ---- building tables -------------------------------------------------------------------------------


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's stand-in character for each byte, as character -> byte: printable
    Latin-1 bytes stand for themselves, the other bytes take the characters from U+0100 on, in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: dict[str, int] = {}
    next_stand_in = 0x100
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(next_stand_in)] = byte
            next_stand_in += 1
    return alphabet


def _byte_level_converter() -> Callable[[str], bytes]:
    alphabet = byte_level_alphabet()
    translation: dict[int, int] = {ord(char): byte for char, byte in alphabet.items()}
    # Latin-1 characters outside the alphabet must not pass the latin-1 encode below unchanged.
    not_in_alphabet = 0xFFFF
    translation.update({code: not_in_alphabet for code in range(256) if chr(code) not in alphabet})

    def to_bytes(token: str) -> bytes:
        # ByteLevel maps a token whose characters are all stand-ins; any other token is kept as text.
        try:
            return token.translate(translation).encode("latin-1")
        except UnicodeEncodeError:
            return token.encode("utf-8")

    return to_bytes


def _byte_fallback_value(token: str) -> int | None:
    """The byte of a `<0xNN>` token, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        if all(c in "0123456789abcdefABCDEF" for c in digits):
            return int(digits, 16)
    return None


def _sentencepiece_converter(byte_fallback: bool) -> Callable[[str], bytes]:
    def to_bytes(token: str) -> bytes:
        value = _byte_fallback_value(token) if byte_fallback else None
        return bytes([value]) if value is not None else token.replace("▁", " ").encode("utf-8")

    return to_bytes


def _sentencepiece_steps(steps: list[dict[str, Any]]) -> tuple[bool, int] | None:
    """(byte_fallback, spaces to strip) for a decoder Sequence [Replace('▁', ' '), ByteFallback?,
    Fuse?, Strip(' ', n, 0)?] in that order (Strip only after Fuse, so it sees the whole text)."""
    if not steps or steps[0] != {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}:
        return None
    rest = steps[1:]
    byte_fallback = bool(rest) and rest[0] == {"type": "ByteFallback"}
    rest = rest[1:] if byte_fallback else rest
    fused = bool(rest) and rest[0] == {"type": "Fuse"}
    rest = rest[1:] if fused else rest
    strip = 0
    if fused and rest and rest[0].get("type") == "Strip":
        if rest[0].get("content") != " " or rest[0].get("stop") != 0:
            return None
        strip = int(rest[0]["start"])
        rest = rest[1:]
    return (byte_fallback, strip) if not rest else None


def _stock_transformers_decode(tokenizer: Any) -> bool:
    """True when `tokenizer.decode` is transformers' own: the backend's decode (+ optional clean-up)."""
    try:
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    )


def build_token_byte_table(tokenizer: Any) -> TokenByteTable | None:
    """A checked table for `tokenizer`, or None when its decode is not a concatenation of bytes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or not _stock_transformers_decode(tokenizer):
        return None
    spec = json.loads(backend.decoder.__getstate__())
    kind = spec.get("type")
    strip = 0
    utf8_errors = "replace"
    if kind == "ByteLevel":
        to_bytes = _byte_level_converter()
    elif kind == "Sequence" and (steps := _sentencepiece_steps(spec.get("decoders", []))) is not None:
        byte_fallback, strip = steps
        to_bytes = _sentencepiece_converter(byte_fallback)
        utf8_errors = REPLACE_EACH_BYTE if byte_fallback else "replace"
    else:
        logger.debug("no byte table for decoder %s: detokenizing by windows", kind)
        return None
    added = backend.get_added_tokens_decoder()
    size = max([backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
    tokens = list(map(backend.id_to_token, range(size)))
    bytes_by_id = [b"" if token is None else to_bytes(token) for token in tokens]
    special_ids = frozenset(i for i, token in added.items() if token.special)
    skipping = [b"" if i in special_ids else data for i, data in enumerate(bytes_by_id)]
    table = TokenByteTable(bytes_by_id, skipping, special_ids, utf8_errors, strip)
    sequences = _check_sequences(tokenizer, table, tokens)
    if sequences is None:
        logger.debug("no one-character ASCII token to check the byte table with: detokenizing by windows")
        return None
    mismatch = first_mismatch(tokenizer, table, sequences)
    if mismatch is not None:
        logger.warning(
            "the token byte table of %s disagrees with tokenizer.decode on %s: detokenizing by windows",
            type(tokenizer).__name__,
            mismatch,
        )
        return None
    return table


def decode_with_table(table: TokenByteTable, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
    """What the table says `tokenizer.decode(token_ids, skip_special_tokens=...)` is."""
    stream = TokenByteStream(table, skip_special_tokens)
    return stream.decode(token_ids) + stream.flush()


def first_mismatch(tokenizer: Any, table: TokenByteTable, sequences: list[list[int]]) -> str | None:
    """The first (sequence, skip_special_tokens) whose table decode differs from tokenizer.decode."""
    for ids in sequences:
        for skip in (False, True):
            expected = tokenizer.decode(ids, skip_special_tokens=skip)
            if decode_with_table(table, ids, skip) != expected:
                return f"{ids[:16]}{'...' if len(ids) > 16 else ''} (skip_special_tokens={skip})"
    return None


def _check_sequences(
    tokenizer: Any, table: TokenByteTable, tokens: list[str | None]
) -> list[list[int]] | None:
    """A vocabulary sample (each id after an anchor: a one-character ASCII token that is neither
    special nor `<0xNN>`, so that byte-fallback runs stay one token long), every added token, the
    start-of-text rule and the clean-up probe; None when the vocabulary has no anchor."""
    size = len(table.bytes_by_id)
    anchor = next(
        (
            i
            for i, data in enumerate(table.bytes_by_id)
            if len(data) == 1
            and 0x21 <= data[0] < 0x7F
            and tokens[i] == chr(data[0])
            and i not in table.special_ids
        ),
        None,
    )
    if anchor is None:
        return None
    stride = max(1, size // SAMPLE_CHECK_SIZE)
    sample = sorted({*range(0, size, stride), *table.special_ids, *range(min(size, 300))})
    interleaved = [token for i in sample for token in (anchor, i)]
    spaced = [i for i, data in enumerate(table.bytes_by_id) if data.startswith(b" ") and len(data) > 1][:8]
    starts = [[i, anchor] for i in spaced] + [[s, *spaced[:1], anchor] for s in sorted(table.special_ids)[:2]]
    probe = list(tokenizer.encode(CLEANUP_PROBE_TEXT, add_special_tokens=False))
    return [interleaved, *starts, probe]


# ---- one table per tokenizer object ---------------------------------------------------------------

# id(tokenizer) -> (weak reference to it, its vocabulary size with added tokens, its table or None).
# An entry leaves when its tokenizer dies; a tokenizer that gained tokens gets a new table.
_tables: dict[int, tuple[weakref.ref[Any], int, TokenByteTable | None]] = {}
_tables_lock = threading.Lock()


def token_byte_table(tokenizer: Any, *, check_added_tokens: bool = True) -> TokenByteTable | None:
    """The cached table of this tokenizer object (built on first use), or None if not eligible.

    check_added_tokens=False skips checking that the tokenizer gained no tokens since its table was
    built (a call into the backend of about 1 µs): the table may then lack ids past its end, which the
    caller must decode otherwise."""
    key = id(tokenizer)
    entry = _tables.get(key)
    if entry is not None and entry[0]() is tokenizer and not check_added_tokens:
        return entry[2]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab_size = backend.get_vocab_size(with_added_tokens=True) if backend is not None else -1
    if entry is not None and entry[0]() is tokenizer and entry[1] == vocab_size:
        return entry[2]
    with _tables_lock:
        entry = _tables.get(key)
        if entry is not None and entry[0]() is tokenizer and entry[1] == vocab_size:
            return entry[2]  # built by another thread meanwhile
        try:
            ref = weakref.ref(tokenizer, lambda _: _tables.pop(key, None))
        except TypeError:
            return None  # cannot tell when it dies, so no table is cached for it
        try:
            table = build_token_byte_table(tokenizer)
        except Exception:  # a fast path only: any surprise means decoding by windows
            name = type(tokenizer).__name__
            logger.warning("no token byte table for %s: detokenizing by windows", name, exc_info=True)
            table = None
        _tables[key] = (ref, vocab_size, table)
        return table
