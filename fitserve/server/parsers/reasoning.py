"""Reasoning parsers: split a model's `<think>...</think>` part from its answer.

One parser instance serves one choice of one request. `feed(delta, finished)` takes the text a
delta at a time and returns what can be shown now; `split(text)` is the same machine run over the
whole output at once, so streamed and non-streamed responses always agree.

Output contract: the reasoning is the text between the opening and the closing tag with surrounding
whitespace removed; the content is the text after the closing tag with leading whitespace removed.
A part that is empty is None.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from fitserve.server.parsers.text_scan import partial_tag_suffix_len, trailing_run_len

_WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class _Phase(enum.Enum):
    UNDECIDED = "undecided"  # not yet known whether the output opens with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    """Base machine; subclasses choose what an output without an opening tag means."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, prompt_text: str = "") -> None:
        self._prompt_text = prompt_text
        self._phase = _Phase.UNDECIDED
        self._untagged_is_reasoning = self.untagged_output_is_reasoning(prompt_text)
        self._pending = ""
        self._reasoning_started = False
        self._content_started = False

    def untagged_output_is_reasoning(self, prompt_text: str) -> bool:
        """Whether an output that does not open with the start tag begins inside the reasoning part."""
        raise NotImplementedError

    def prompt_leaves_tag_open(self, prompt_text: str) -> bool:
        """True when the rendered prompt opened a reasoning block that it did not close."""
        opened = prompt_text.rfind(self.start_tag)
        return opened >= 0 and prompt_text.find(self.end_tag, opened) < 0

    def split(self, text: str) -> ReasoningDelta:
        """Split a complete output with a fresh machine for the same prompt (this one is untouched)."""
        return type(self)(self._prompt_text).feed(text, finished=True)

    def feed(self, delta: str, finished: bool) -> ReasoningDelta:
        self._pending += delta
        reasoning: list[str] = []
        content: list[str] = []
        if self._phase is _Phase.UNDECIDED:
            self._decide(finished)
        if self._phase is _Phase.REASONING:
            self._scan_reasoning(reasoning, finished)
        if self._phase is _Phase.CONTENT:
            self._emit_content(content)
        return ReasoningDelta(reasoning="".join(reasoning) or None, content="".join(content) or None)

    def _decide(self, finished: bool) -> None:
        head = self._pending.lstrip(_WHITESPACE)
        if head.startswith(self.start_tag):
            self._pending = head[len(self.start_tag) :]
            self._phase = _Phase.REASONING
        elif self.start_tag.startswith(head) and not finished:
            return  # still could become the start tag: wait for more text
        else:
            self._phase = _Phase.REASONING if self._untagged_is_reasoning else _Phase.CONTENT

    def _scan_reasoning(self, out: list[str], finished: bool) -> None:
        end = self._pending.find(self.end_tag)
        if end >= 0:
            out.append(self._reasoning_piece(self._pending[:end].rstrip(_WHITESPACE)))
            self._pending = self._pending[end + len(self.end_tag) :]
            self._phase = _Phase.CONTENT
            return
        if finished:
            out.append(self._reasoning_piece(self._pending.rstrip(_WHITESPACE)))
            self._pending = ""
            return
        held = partial_tag_suffix_len(self._pending, self.end_tag)
        held += trailing_run_len(self._pending[: len(self._pending) - held], _WHITESPACE)
        ready = self._pending[: len(self._pending) - held]
        self._pending = self._pending[len(ready) :]
        out.append(self._reasoning_piece(ready))

    def _reasoning_piece(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip(_WHITESPACE)
            self._reasoning_started = bool(text)
        return text

    def _emit_content(self, out: list[str]) -> None:
        text, self._pending = self._pending, ""
        if not self._content_started:
            text = text.lstrip(_WHITESPACE)
            self._content_started = bool(text)
        out.append(text)
