"""Reasoning parsers: split a model's `<think>...</think>` part from its answer.

One parser instance serves one choice of one request. `feed(delta, finished)` takes the text a
delta at a time and returns what can be shown now; `split(text)` is the same machine run over the
whole output at once, so streamed and non-streamed responses always agree.

Which text is reasoning: the text after an opening tag that starts the output, or from the start of
the output when the rendered prompt left a `<think>` open (templates that open the block for the
model), up to the closing tag or, when generation stopped first, to the end. An output with no tag
at all, after a prompt that opened none, is all content (a model that does not reason). A closing
tag with no opening one anywhere is read per parser: `lone_end_tag_marks_reasoning`.

Output contract: the reasoning is the text between the opening and the closing tag with surrounding
whitespace removed; the content is the text after the closing tag with leading whitespace removed.
A part that is empty is None.

Per-format options: `reasoning_label` names the block right after its opening (Gemma-4 writes
`<|channel>thought` and a new line) and is dropped; `end_of_output_markers` are texts of end-of-turn
tokens that are dropped where they end the output; `keeps_special_tokens` asks the server to decode
special tokens into the text (the format's tags are special tokens), as vLLM's parsers of such formats
do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from fitserve.server.parsers.text_scan import (
    drop_end_marker,
    marker_suffix_len,
    partial_tag_suffix_len,
    trailing_run_len,
)

_WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning: str | None = None
    content: str | None = None


class _Phase(enum.Enum):
    UNDECIDED = "undecided"  # not yet known whether the output opens with the start tag
    REASONING = "reasoning"
    UNTAGGED = "untagged"  # no tag opened: reasoning if a closing tag comes, content if none does
    CONTENT = "content"


class ReasoningParser:
    """Base machine; subclasses name themselves and choose `lone_end_tag_marks_reasoning`."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Whether an output that opens no tag, after a prompt that opened none, is still reasoning up to a
    # closing tag found later. True costs streaming: such text is held back until the closing tag or
    # the end of the output tells which part it is.
    lone_end_tag_marks_reasoning: ClassVar[bool] = False
    reasoning_label: ClassVar[str] = ""
    end_of_output_markers: ClassVar[tuple[str, ...]] = ()
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, prompt_text: str = "") -> None:
        self._prompt_text = prompt_text
        self._phase = _Phase.UNDECIDED
        self._prompt_opened = self.prompt_leaves_tag_open(prompt_text)
        self._pending = ""
        self._held: list[str] = []  # untagged text already known to hold no closing tag
        self._reasoning_started = False
        self._content_started = False
        self._label_pending = bool(self.reasoning_label)

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
        if self._phase is _Phase.UNTAGGED:
            self._scan_untagged(finished)
        if self._phase is _Phase.REASONING and self._label_pending:
            self._drop_label(finished)
        if self._phase is _Phase.REASONING and not self._label_pending:
            self._scan_reasoning(reasoning, finished)
        if self._phase is _Phase.CONTENT:
            self._emit_content(content, finished)
        return ReasoningDelta(reasoning="".join(reasoning) or None, content="".join(content) or None)

    def _decide(self, finished: bool) -> None:
        head = self._pending.lstrip(_WHITESPACE)
        if head.startswith(self.start_tag):
            self._pending = head[len(self.start_tag) :]
            self._phase = _Phase.REASONING
        elif self.start_tag.startswith(head) and not finished:
            return  # still could become the start tag: wait for more text
        elif self._prompt_opened:
            self._phase = _Phase.REASONING
        elif self.lone_end_tag_marks_reasoning:
            self._phase = _Phase.UNTAGGED
        else:
            self._phase = _Phase.CONTENT

    def _scan_untagged(self, finished: bool) -> None:
        """Holds the text back until a closing tag (all before it is reasoning) or the end (all content).

        `_pending` keeps only the last `len(end_tag) - 1` characters (a tag split across deltas still
        shows up whole), so each delta is searched once however long the held text grows.
        """
        found = self.end_tag in self._pending
        if found or finished:
            self._pending = "".join(self._held) + self._pending
            self._held = []
            self._phase = _Phase.REASONING if found else _Phase.CONTENT
            return
        keep = min(len(self._pending), len(self.end_tag) - 1)
        self._held.append(self._pending[: len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep :]

    def _drop_label(self, finished: bool) -> None:
        """Drops `reasoning_label` where it opens the reasoning, followed by a new line or the closing tag
        (or the end); waits while the text so far could still be the label."""
        label, text = self.reasoning_label, self._pending
        if text.startswith(label):
            rest = text[len(label) :]
            if rest.startswith("\n"):
                self._pending = rest[1:]
            elif rest.startswith(self.end_tag) or (finished and not rest):
                self._pending = rest
            elif not finished and self.end_tag.startswith(rest):
                return  # the new line or the closing tag may still come
        elif not finished and label.startswith(text):
            return
        self._label_pending = False

    def _scan_reasoning(self, out: list[str], finished: bool) -> None:
        end = self._pending.find(self.end_tag)
        if end >= 0:
            out.append(self._reasoning_piece(self._pending[:end].rstrip(_WHITESPACE)))
            self._pending = self._pending[end + len(self.end_tag) :]
            self._phase = _Phase.CONTENT
            return
        if finished:
            text = drop_end_marker(self._pending, self.end_of_output_markers)
            out.append(self._reasoning_piece(text.rstrip(_WHITESPACE)))
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

    def _emit_content(self, out: list[str], finished: bool) -> None:
        markers = self.end_of_output_markers
        if finished:
            text, self._pending = drop_end_marker(self._pending, markers), ""
        else:
            held = marker_suffix_len(self._pending, markers)
            text, self._pending = (
                self._pending[: len(self._pending) - held],
                self._pending[len(self._pending) - held :],
            )
        if not self._content_started:
            text = text.lstrip(_WHITESPACE)
            self._content_started = bool(text)
        out.append(text)
