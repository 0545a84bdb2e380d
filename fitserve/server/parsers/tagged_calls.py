"""The text between tool calls, for formats whose calls sit between markers in the text (hermes, gemma4).

Whitespace that only separates a call from the text around it is dropped: the text after a call loses its
leading whitespace, and whitespace before a call (or at the end, after a call) is held back until it is
known whether a call follows. Calls are numbered in the order they appear.
"""

from __future__ import annotations

from typing import Any

from fitserve.server.parsers.text_scan import trailing_run_len
from fitserve.server.parsers.tool_calls import ToolParser

WHITESPACE = " \t\r\n"


class TaggedToolParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._next_index = 0
        self._after_call = False  # a call has ended: leading whitespace of the next text is dropped
        self._segment_started = False

    def _emit_text(self, content: list[str], text: str) -> None:
        if self._after_call and not self._segment_started:
            text = text.lstrip(WHITESPACE)
            self._segment_started = bool(text)
        content.append(text)

    def _emit_text_holding(self, content: list[str], finished: bool, held: int) -> bool:
        """Emits the pending text but its last `held` characters (a marker's possible start) and the
        whitespace before them; at the end of the output, all of it (but trailing whitespace after a
        call). Returns False: the text scan has nothing more to do until more text arrives."""
        if finished:
            rest = self._pending.rstrip(WHITESPACE) if self._after_call else self._pending
            self._emit_text(content, rest)
            self._pending = ""
            return False
        held += trailing_run_len(self._pending[: len(self._pending) - held], WHITESPACE)
        self._emit_text(content, self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    def _call_ended(self) -> None:
        self._after_call, self._segment_started = True, False

    def _take_index(self) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        return index
