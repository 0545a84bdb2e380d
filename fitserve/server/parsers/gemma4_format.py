"""Gemma-4's tool-call syntax, read into Python values (the part both Gemma-4 parsers share).

Gemma-4 writes a call as `<|tool_call>call:NAME{ARGS}<tool_call|>` (several calls follow each other
with nothing between them). ARGS is not JSON: it is what the model's chat template renders for an
argument object, `key:value` pairs joined by `,` with bare keys, where a value is

- a string between two `<|"|>` tokens, taken literally: quotes, backslashes, braces, commas and new
  lines inside it are text, with no escaping of any kind (the `<|"|>` token is the only delimiter);
- `true` / `false`;
- an object `{key:value,...}` (keys bare; a key between `<|"|>` tokens is read too);
- a list `[value,...]`;
- anything else as the template prints it: numbers (`42`, `-1.5`, `1e-05`), and `None` for null
  (Jinja prints Python's None so; `null`, `none` and `nil` are read the same way).

A bare value that is none of these is kept as a string, as vLLM's gemma4 parser does (a `:` in it
means a missing `,` and is refused).
`parse_call(body)` reads the text between the call markers; anything that does not follow the syntax
makes it return None, so the caller can keep the text as content.
"""

from __future__ import annotations

import re
from typing import Any

CALL_START = "<|tool_call>"
CALL_END = "<tool_call|>"
STRING_DELIM = '<|"|>'
# Tokens that end a Gemma-4 generation (generation_config eos_token_id 1, 106, 50): <eos>, the end of
# the model's turn, and the start of a tool response (the model stops there to wait for the result).
# vLLM leaves the stopping token out of the text; where it shows (skip_special_tokens=False), the
# Gemma-4 parsers drop it from the end of the output.
END_OF_OUTPUT_MARKERS = ("<turn|>", "<eos>", "<|tool_response>")

_WHITESPACE = " \t\r\n"
_NAME = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\s*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NULLS = frozenset({"None", "null", "none", "nil"})
_BARE_VALUE_ENDS = ",}]"


class Gemma4SyntaxError(ValueError):
    """The text does not follow Gemma-4's argument syntax."""


def parse_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """`call:NAME{ARGS}` -> (NAME, ARGS as a dict), or None when `body` is not a well-formed call."""
    header = _NAME.match(body)
    if header is None or not body.startswith("{", header.end()):
        return None
    reader = _Reader(body, header.end())
    try:
        arguments = reader.value()
        reader.skip_whitespace()
        if reader.pos != len(body):
            raise Gemma4SyntaxError(f"text after the arguments at offset {reader.pos}")
    except Gemma4SyntaxError:
        return None
    return header.group(1), arguments


def bare_value(text: str) -> Any:
    """A value written without string delimiters: a boolean, null, a number, or else the text itself."""
    if text in ("true", "false"):
        return text == "true"
    if text in _NULLS:
        return None
    number = _NUMBER.fullmatch(text)
    if number is None:
        return text
    return float(text) if number.group(1) or number.group(2) else int(text)


class _Reader:
    """Recursive-descent reader over one call's text, from `pos`."""

    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def skip_whitespace(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1

    def value(self) -> Any:
        self.skip_whitespace()
        if self.text.startswith(STRING_DELIM, self.pos):
            return self.string()
        if self.text.startswith("{", self.pos):
            return self.mapping()
        if self.text.startswith("[", self.pos):
            return self.sequence()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _BARE_VALUE_ENDS:
            if self.text.startswith(STRING_DELIM, self.pos) or self.text[self.pos] in "{[:":
                raise Gemma4SyntaxError(f"a value runs into {self.text[self.pos]!r} at offset {self.pos}")
            self.pos += 1
        raw = self.text[start : self.pos].strip(_WHITESPACE)
        if not raw:
            raise Gemma4SyntaxError(f"a value is missing at offset {start}")
        return bare_value(raw)

    def string(self) -> str:
        start = self.pos + len(STRING_DELIM)
        end = self.text.find(STRING_DELIM, start)
        if end < 0:
            raise Gemma4SyntaxError(f"the string opened at offset {self.pos} is not closed")
        self.pos = end + len(STRING_DELIM)
        return self.text[start:end]

    def mapping(self) -> dict[str, Any]:
        self.pos += 1  # "{"
        result: dict[str, Any] = {}
        while True:
            self.skip_whitespace()
            if self.text.startswith("}", self.pos):
                self.pos += 1
                return result
            key = self.key()
            result[key] = self.value()
            self.after_item("}")

    def sequence(self) -> list[Any]:
        self.pos += 1  # "["
        result: list[Any] = []
        while True:
            self.skip_whitespace()
            if self.text.startswith("]", self.pos):
                self.pos += 1
                return result
            result.append(self.value())
            self.after_item("]")

    def key(self) -> str:
        if self.text.startswith(STRING_DELIM, self.pos):
            key = self.string()
            self.skip_whitespace()
        else:
            start = self.pos
            while self.pos < len(self.text) and self.text[self.pos] not in ":,{}[]<":
                self.pos += 1
            key = self.text[start : self.pos].strip(_WHITESPACE)
            if not key:
                raise Gemma4SyntaxError(f"a key is missing at offset {start}")
        if not self.text.startswith(":", self.pos):
            raise Gemma4SyntaxError(f"the key {key!r} is not followed by ':' at offset {self.pos}")
        self.pos += 1
        return key

    def after_item(self, closer: str) -> None:
        """After a key's value or a list item: a ',' (consumed) or the closing bracket (left for the loop)."""
        self.skip_whitespace()
        if self.text.startswith(",", self.pos):
            self.pos += 1
        elif not self.text.startswith(closer, self.pos):
            raise Gemma4SyntaxError(f"expected ',' or {closer!r} at offset {self.pos}")
