"""`--tool-call-parser gemma4`: Gemma-4's `<|tool_call>call:NAME{ARGS}<tool_call|>` calls.

The syntax is in gemma4_format.py. Text outside the calls is content, streamed as it comes
(whitespace that only separates a call from the text around it is dropped, as the hermes parser
does). A call is sent whole, id, name and JSON arguments in one fragment, once its `<tool_call|>`
arrives: until then its text may still turn out not to be a call (an argument that breaks the
syntax, or an output cut off by max_tokens), and such a block is passed through as content, markers
included, so nothing the model wrote is lost. A `<tool_call|>` inside a `<|"|>` string does not end
the call; a `<|tool_call>` outside one, before the call closed, ends the unclosed block (content)
and starts the next call. The markers are special tokens: the server decodes special tokens into
the text while this parser handles a request (vLLM's gemma4 parser does the same).
"""

from __future__ import annotations

import json

from fitserve.server.parsers.gemma4_format import (
    CALL_END,
    CALL_START,
    END_OF_OUTPUT_MARKERS,
    STRING_DELIM,
    parse_call,
)
from fitserve.server.parsers.tagged_calls import WHITESPACE, TaggedToolParser
from fitserve.server.parsers.text_scan import (
    drop_end_marker,
    marker_suffix_len,
    partial_tag_suffix_len,
)
from fitserve.server.parsers.tool_calls import ToolCallDelta, new_tool_call_id

_CALL_MARKERS = (STRING_DELIM, CALL_END, CALL_START)


class Gemma4ToolParser(TaggedToolParser):
    name = "gemma4"
    keeps_special_tokens = True

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._scanned = 0  # offset in the open call's text searched for its end so far
        self._in_string = False  # the scan is inside a <|"|> string
        self._space_before_call = ""  # whitespace cut from before the open call (kept if it is no call)

    def _on_finished(self, pending: str) -> str:
        return drop_end_marker(pending, END_OF_OUTPUT_MARKERS)

    def _scan_text(self, content: list[str], finished: bool) -> bool:
        opened = self._pending.find(CALL_START)
        if opened >= 0:
            before = self._pending[:opened]
            kept = before.rstrip(WHITESPACE)
            self._emit_text(content, kept)
            self._space_before_call = before[len(kept) :]
            self._pending = self._pending[opened + len(CALL_START) :]
            self._in_call, self._scanned, self._in_string = True, 0, False
            return True
        held = max(
            partial_tag_suffix_len(self._pending, CALL_START),
            marker_suffix_len(self._pending, END_OF_OUTPUT_MARKERS),
        )
        return self._emit_text_holding(content, finished, held)

    def _scan_call(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        end, resume = self._find_call_end(finished)
        if end < 0:
            if not finished:
                return False
            end = resume = len(self._pending)
        body, closed = self._pending[:end], resume > end
        self._pending = self._pending[resume:]
        self._in_call = False
        parsed = parse_call(body) if closed else None
        if parsed is None:
            self._emit_text(
                content, self._space_before_call + CALL_START + body + (CALL_END if closed else "")
            )
            return True
        name, arguments = parsed
        text = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCallDelta(self._take_index(), new_tool_call_id(), name, text))
        self._call_ended()
        return True

    def _find_call_end(self, finished: bool) -> tuple[int, int]:
        """(where the open call's text ends, where the text after it starts), or (-1, -1) while unknown.

        Searches on from where the last feed stopped, so each delta is read once; stops before a `<`
        that may begin a marker the next delta completes.
        """
        text, position = self._pending, self._scanned
        while True:
            found = text.find("<", position)
            if found < 0:
                self._scanned = len(text)
                return -1, -1
            if text.startswith(STRING_DELIM, found):
                self._in_string = not self._in_string
                position = found + len(STRING_DELIM)
                continue
            if not self._in_string and text.startswith(CALL_END, found):
                return found, found + len(CALL_END)
            if not self._in_string and text.startswith(CALL_START, found):
                return found, found  # the next call starts before this one closed
            if not finished and any(marker.startswith(text[found:]) for marker in _CALL_MARKERS):
                self._scanned = found
                return -1, -1
            position = found + 1
