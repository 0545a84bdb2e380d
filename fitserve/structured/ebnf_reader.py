"""xgrammar's printed grammars (EBNF) read into expressions, for measuring them (min_tokens.py): one rule
per line of strings, character classes, sequences, choices, repetition, rule references, lookaheads and
the `Regex("...", json_string=true)` leaves of schema patterns. An unknown construct raises
GrammarReadError (the measure then gives no bound): this reads, it compiles nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class GrammarReadError(ValueError):
    """The printed grammar holds a construct this reader does not know: no bound is given."""


@dataclass(frozen=True)
class Chars:
    """A string literal: each item a code point, or ("x", n) for a \\xNN escape (a code point below 256
    or one raw byte: the cheaper reading is taken)."""

    items: tuple[Any, ...]


@dataclass(frozen=True)
class CharClass:
    """A character class: (low, high) code point ranges; negated matches any character not in them."""

    negated: bool
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RegexLeaf:
    """xgrammar's Regex("pattern", json_string=true) element (a JSON schema's string pattern): the pattern
    is measured through xgrammar's own regex-to-EBNF conversion; json_string: its characters may be
    written as JSON escapes."""

    pattern: str
    json_string: bool


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_PLAIN = re.compile(r'[^"\\]+')  # a string literal's characters up to a quote or a backslash
_ESCAPES = {"n": 10, "r": 13, "t": 9, "0": 0, "b": 8, "f": 12, "v": 11, "a": 7, "e": 27}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class _Reader:
    """A recursive-descent reader of one rule of the EBNF xgrammar prints (str(Grammar)): `name ::= expr`,
    an optional lookahead `(= expr)` after it (it consumes nothing, so it is read and dropped)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, what: str) -> GrammarReadError:
        return GrammarReadError(f"{what} at character {self.pos}: {self.text[self.pos : self.pos + 30]!r}")

    def skip_space(self) -> None:
        while self.text.startswith(" ", self.pos) or self.text.startswith("\t", self.pos):
            self.pos += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def name(self) -> str:
        self.skip_space()
        match = _NAME.match(self.text, self.pos)
        if match is None:
            raise self.error("expected a rule name")
        self.pos = match.end()
        return match[0]

    def body(self) -> Any:
        """One rule's body (the rest of its line): the expression, then an optional lookahead."""
        body = self.choice()
        if self.text.startswith("(=", self.pos):  # lookahead: consumes nothing
            self.pos += 2
            self.choice()
            self.expect(")")
        if self.peek():
            raise self.error("unexpected text after the rule")
        return body

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise self.error(f"expected {char!r}")
        self.pos += 1

    def choice(self) -> Any:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", tuple(options))

    def sequence(self) -> Any:
        items = []
        while True:
            char = self.peek()
            if char in ("", "|", ")") or (char == "(" and self.text.startswith("(=", self.pos)):
                break
            items.append(self.repeated())
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def repeated(self) -> Any:
        item = self.atom()
        while True:
            char = self.text[self.pos] if self.pos < len(self.text) else ""
            if char == "*" or char == "?":
                self.pos += 1
                item = ("rep", item, 0)
            elif char == "+":
                self.pos += 1
                item = ("rep", item, 1)
            elif char == "{":
                end = self.text.find("}", self.pos)
                if end < 0:
                    raise self.error("unclosed repetition")
                low = self.text[self.pos + 1 : end].split(",")[0].strip()
                if not low.isdigit():
                    raise self.error("a repetition without a minimum count")
                self.pos = end + 1
                item = ("rep", item, int(low))
            else:
                return item

    def atom(self) -> Any:
        char = self.peek()
        if char == "(":
            self.pos += 1
            inner = self.choice()
            self.expect(")")
            return inner
        if char == '"':
            return self.string()
        if char == "[":
            return self.char_class()
        if self.text.startswith("Regex(", self.pos):
            return self.regex()
        if char.isalpha() or char == "_":
            return ("ref", self.name())
        raise self.error("an element this reader does not know")

    def regex(self) -> RegexLeaf:
        self.pos += len("Regex(")
        if self.peek() != '"':
            raise self.error("expected the regex's string")
        items = self.string().items
        pattern = "".join(chr(item[1] if isinstance(item, tuple) else item) for item in items)
        options = {}
        while self.peek() == ",":
            self.pos += 1
            key = self.name()
            self.expect("=")
            options[key] = self.name()
        self.expect(")")
        unknown = set(options) - {"json_string"}
        if unknown:
            raise self.error(f"unknown Regex options {sorted(unknown)}")
        return RegexLeaf(pattern, options.get("json_string") == "true")

    def escape(self) -> Any:
        """The code point after a backslash (self.pos at the backslash); ("x", n) for \\xNN."""
        letter = self.text[self.pos + 1 : self.pos + 2]
        if letter in _HEX_DIGITS:
            digits = self.text[self.pos + 2 : self.pos + 2 + _HEX_DIGITS[letter]]
            if len(digits) != _HEX_DIGITS[letter] or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise self.error("a bad escape")
            self.pos += 2 + len(digits)
            return ("x", int(digits, 16)) if letter == "x" else int(digits, 16)
        if not letter:
            raise self.error("a backslash at the end")
        self.pos += 2
        return _ESCAPES.get(letter, ord(letter))

    def string(self) -> Chars:
        self.pos += 1  # the opening quote
        items: list[Any] = []
        while True:
            plain = _PLAIN.match(self.text, self.pos)
            if plain is not None:
                items.extend(map(ord, plain[0]))
                self.pos = plain.end()
            if self.pos >= len(self.text):
                raise self.error("an unclosed string")
            if self.text[self.pos] == '"':
                self.pos += 1
                return Chars(tuple(items))
            items.append(self.escape())

    def class_char(self) -> int:
        if self.pos >= len(self.text):
            raise self.error("an unclosed character class")
        if self.text[self.pos] == "\\":
            value = self.escape()
            return value[1] if isinstance(value, tuple) else value
        self.pos += 1
        return ord(self.text[self.pos - 1])

    def char_class(self) -> CharClass:
        self.pos += 1  # the opening bracket
        negated = self.text.startswith("^", self.pos)
        self.pos += negated
        ranges = []
        while not self.text.startswith("]", self.pos):
            low = self.class_char()
            high = low
            if self.text.startswith("-", self.pos) and not self.text.startswith("-]", self.pos):
                self.pos += 1
                high = self.class_char()
            ranges.append((low, high))
        self.pos += 1
        return CharClass(negated, tuple(ranges))


_DEFINITION = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*::=")


def read_ebnf(text: str) -> dict[str, Any]:
    """The rules of a printed xgrammar grammar, name -> expression (GrammarReadError if unreadable).
    xgrammar prints one rule per line (a newline in a literal is printed as an escape)."""
    rules: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        definition = _DEFINITION.match(line)
        if definition is None:
            raise GrammarReadError(f"a line that is not a rule: {line[:40]!r}")
        reader = _Reader(line)
        reader.pos = definition.end()
        rules[definition[1]] = reader.body()
    return rules
