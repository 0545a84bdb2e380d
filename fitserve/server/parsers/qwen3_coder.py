"""`--tool-call-parser qwen3_coder`: the XML-style calls of Qwen3-Coder, Qwen3.5 and Qwen3.6.

A call is written

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

and becomes a `tool_calls` entry with JSON arguments `{"city": "Paris", "days": 3}`: each value is the
raw text between its tags, less the one new line the template puts after the opening tag and before
the closing one, read into the type its tool schema declares (qwen3_coder_values.py). Several calls
follow each other (a `<tool_call>` block may also hold several functions); a `<function=...>` without
the `<tool_call>` around it is read as a call too, as vLLM's parser reads it. Text outside the calls is
content (whitespace that only separates it from a call is dropped, as the hermes parser does).

Streaming: the call's id and name are sent once `<function=NAME>` is complete, then its arguments as
JSON fragments that concatenate to the arguments text: `{"city": ` and the value when a parameter
ends, `}` when the function does. A parameter whose schema says string streams its text as it comes
(a long file a coding agent writes arrives piece by piece); other values are sent whole, once their
type can be read. A marker split across deltas is held back, so no partial markup reaches the content.

Which `</parameter>` ends a value: one followed (after whitespace) by `<parameter=`, `</function>`,
`</tool_call>` or the end of the output; any other is text of the value (code that mentions the tag).
A value left without its `</parameter>` ends at a `</function>` followed by `</tool_call>` or the
end. So a closing tag is sent one marker late while streaming; both paths give the same result.

Malformed markup: a `<tool_call>` block that does not start with a `<function=NAME>` header is read as
a hermes-style JSON call if it is one, else kept in `content` as written, markers included; so is an
unterminated header at the end of the output. An output cut off inside a call (max_tokens) still ends
the call: the parameters read so far, the last one up to the end of the output. Stray text between
the parts of a call is dropped.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from fitserve.server.parsers.qwen3_coder_values import convert_value, declared_type, tool_properties
from fitserve.server.parsers.tagged_calls import WHITESPACE, TaggedToolParser
from fitserve.server.parsers.text_scan import partial_tag_suffix_len
from fitserve.server.parsers.tool_calls import ToolCallDelta, new_tool_call_id

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
# What may follow (after whitespace) a `</parameter>` that ends a value, or a `</function>` that ends a
# value left without its `</parameter>`; the end of the output also may.
_AFTER_PARAMETER_END = (PARAMETER, FUNCTION_END, TOOL_CALL_END)
_AFTER_FUNCTION_END = (TOOL_CALL_END,)
_BODY_MARKERS = (PARAMETER, FUNCTION_END, TOOL_CALL_END, FUNCTION)
_NAME_ENDS = ">\n<"


class _Phase(enum.Enum):
    HEADER = "header"  # before `<function=NAME>`
    BODY = "body"  # between the parameters of a function
    VALUE = "value"  # inside a parameter's value
    AFTER_FUNCTION = "after function"  # after `</function>`: `</tool_call>` or another function
    RAW_BLOCK = "raw block"  # a `<tool_call>` block with no function header, read whole at its end


class Qwen3CoderToolParser(TaggedToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._properties = tool_properties(self.tools)
        self._phase = _Phase.HEADER
        self._in_block = False  # the call sits in a `<tool_call>` block (else a bare `<function=`)
        self._block_calls = 0  # functions read in the open block
        self._space_before_call = ""  # whitespace cut from before the block (kept if it is no call)
        self._call_index = -1
        self._call_schema: dict[str, Any] | None = None  # the called tool's properties, None if unknown
        self._arguments_opened = False  # the `{` of the call's arguments was sent
        self._param_name = ""
        self._param_schema: Any = None
        self._param_streams = False  # a string parameter: its text is sent as it comes
        self._param_opened = False  # its `"name": ` (and opening quote) was sent
        self._value_started = False  # the new line after the opening tag was dealt with
        self._value_parts: list[str] = []  # text of a value sent whole, gathered until it ends
        self._scanned = 0  # offset in the value's pending text searched for its end so far

    # The text between calls.

    def _scan_text(self, content: list[str], finished: bool) -> bool:
        opened, marker = _first_of(self._pending, (TOOL_CALL, FUNCTION))
        if opened >= 0:
            before = self._pending[:opened]
            kept = before.rstrip(WHITESPACE)
            self._emit_text(content, kept)
            self._space_before_call = before[len(kept) :]
            self._in_block = marker == TOOL_CALL
            self._pending = self._pending[opened + (len(TOOL_CALL) if self._in_block else 0) :]
            self._in_call, self._phase, self._block_calls = True, _Phase.HEADER, 0
            return True
        held = max(partial_tag_suffix_len(self._pending, marker) for marker in (TOOL_CALL, FUNCTION))
        return self._emit_text_holding(content, finished, held)

    def _scan_call(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        if self._phase is _Phase.HEADER:
            return self._scan_header(content, calls, finished)
        if self._phase is _Phase.BODY:
            return self._scan_body(calls, finished)
        if self._phase is _Phase.VALUE:
            return self._scan_value(calls, finished)
        if self._phase is _Phase.AFTER_FUNCTION:
            return self._scan_after_function(finished)
        return self._scan_raw_block(content, calls, finished)

    # `<function=NAME>`.

    def _scan_header(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        body = self._pending.lstrip(WHITESPACE) if self._in_block else self._pending
        if not body.startswith(FUNCTION):
            if not finished and FUNCTION.startswith(body):
                return False
            return self._refuse_header(content)
        end = _find_any(body, _NAME_ENDS, len(FUNCTION))
        if end < 0 and not finished:
            return False
        name = body[len(FUNCTION) : end].strip(WHITESPACE) if end >= 0 else ""
        if end < 0 or body[end] != ">" or not name:
            return self._refuse_header(content)
        self._pending = body[end + 1 :]
        self._call_index = self._take_index()
        self._block_calls += 1
        calls.append(ToolCallDelta(self._call_index, new_tool_call_id(), name, ""))
        self._call_schema = self._properties.get(name)
        self._arguments_opened = False
        self._phase = _Phase.BODY
        return True

    def _refuse_header(self, content: list[str]) -> bool:
        """A header that is not `<function=NAME>`: the block is read whole (a `<tool_call>` block), the
        marker is text (a bare `<function=`), or the rest of the block is skipped (after a call)."""
        if self._in_block and self._block_calls == 0:
            self._phase = _Phase.RAW_BLOCK
        elif self._in_block:
            self._phase = _Phase.AFTER_FUNCTION
            self._pending = self._pending.lstrip(WHITESPACE)[1:]
        else:
            self._emit_text(content, self._space_before_call + FUNCTION)
            self._pending = self._pending[len(FUNCTION) :]
            self._in_call = False
        return True

    # Between parameters.

    def _scan_body(self, calls: list[ToolCallDelta], finished: bool) -> bool:
        body = self._pending.lstrip(WHITESPACE)
        if body.startswith(PARAMETER):
            end = _find_any(body, _NAME_ENDS, len(PARAMETER))
            if end < 0 and not finished:
                self._pending = body
                return False
            name = body[len(PARAMETER) : end].strip(WHITESPACE) if end >= 0 else ""
            if end < 0 or body[end] != ">" or not name:
                self._pending = body[1:]  # not a parameter tag: stray text
                return True
            self._pending = body[end + 1 :]
            self._start_value(name)
            return True
        if body.startswith(FUNCTION_END):
            self._pending = body[len(FUNCTION_END) :]
            self._close_arguments(calls)
            self._phase = _Phase.AFTER_FUNCTION
            return True
        if body.startswith((TOOL_CALL_END, FUNCTION)):  # the function was left without `</function>`
            self._pending = body
            self._close_arguments(calls)
            self._phase = _Phase.AFTER_FUNCTION
            return True
        if not body:
            self._pending = ""
            if finished:
                self._close_arguments(calls)
                self._end_call()
            return False
        if not finished and any(marker.startswith(body) for marker in _BODY_MARKERS):
            self._pending = body
            return False
        self._pending = _skip_stray(body)
        return True

    def _close_arguments(self, calls: list[ToolCallDelta]) -> None:
        calls.append(ToolCallDelta(self._call_index, arguments="}" if self._arguments_opened else "{}"))

    # `<parameter=NAME>` VALUE `</parameter>`.

    def _start_value(self, name: str) -> None:
        self._param_name = name
        self._param_schema = self._call_schema.get(name) if self._call_schema is not None else None
        kind, nullable = declared_type(self._param_schema)
        self._param_streams = kind == "string" and not nullable
        self._param_opened = False
        self._value_started = False
        self._value_parts = []
        self._scanned = 0
        self._phase = _Phase.VALUE

    def _scan_value(self, calls: list[ToolCallDelta], finished: bool) -> bool:
        if not self._value_started:
            if not self._pending and not finished:
                return False
            if self._pending.startswith("\n"):
                self._pending = self._pending[1:]
            self._value_started = True
        end, resume = self._find_value_end(finished)
        if end < 0:
            ready = self._scanned
            if ready > 0 and self._pending[ready - 1] == "\n":
                ready -= 1  # the new line before the closing tag is not part of the value
            if ready > 0:
                self._take_value_text(self._pending[:ready], calls)
                self._pending = self._pending[ready:]
                self._scanned -= ready
            return False
        text = self._pending[:end]
        self._take_value_text(text[:-1] if text.endswith("\n") else text, calls)
        self._pending = self._pending[resume:]
        self._end_value(calls)
        self._phase = _Phase.BODY
        return True

    def _find_value_end(self, finished: bool) -> tuple[int, int]:
        """(where the value's text ends, where the text after it starts), or (-1, -1) while unknown.

        Searches on from where the last feed stopped; `_scanned` ends where the value's text is known
        to go on (before a closing tag whose meaning waits on the text after it)."""
        text, position = self._pending, self._scanned
        while True:
            found = text.find("</", position)
            if found < 0:
                if finished:
                    return len(text), len(text)
                self._scanned = len(text) - (1 if text.endswith("<") else 0)
                return -1, -1
            rest = text[found:]
            verdict: bool | None = False
            if rest.startswith(PARAMETER_END):
                verdict = _followed_by(text, found + len(PARAMETER_END), _AFTER_PARAMETER_END, finished)
                if verdict:
                    return found, found + len(PARAMETER_END)
            elif rest.startswith(FUNCTION_END):
                verdict = _followed_by(text, found + len(FUNCTION_END), _AFTER_FUNCTION_END, finished)
                if verdict:
                    return found, found  # the body scan closes the function
            elif not finished and (PARAMETER_END.startswith(rest) or FUNCTION_END.startswith(rest)):
                verdict = None
            if verdict is None:
                self._scanned = found
                return -1, -1
            position = found + 1

    def _take_value_text(self, text: str, calls: list[ToolCallDelta]) -> None:
        if not self._param_streams:
            self._value_parts.append(text)
            return
        piece = json.dumps(text, ensure_ascii=False)[1:-1]
        if not self._param_opened:
            piece = self._key_prefix() + '"' + piece
        if piece:
            calls.append(ToolCallDelta(self._call_index, arguments=piece))

    def _end_value(self, calls: list[ToolCallDelta]) -> None:
        if self._param_streams:
            closing = '"' if self._param_opened else self._key_prefix() + '""'
            calls.append(ToolCallDelta(self._call_index, arguments=closing))
            return
        value = convert_value("".join(self._value_parts), self._param_schema)
        self._value_parts = []
        text = json.dumps(value, ensure_ascii=False)
        calls.append(ToolCallDelta(self._call_index, arguments=self._key_prefix() + text))

    def _key_prefix(self) -> str:
        """`{"name": ` for a call's first parameter, `, "name": ` for the others."""
        prefix = ", " if self._arguments_opened else "{"
        self._arguments_opened = self._param_opened = True
        return prefix + json.dumps(self._param_name, ensure_ascii=False) + ": "

    # After `</function>`.

    def _scan_after_function(self, finished: bool) -> bool:
        body = self._pending.lstrip(WHITESPACE)
        if body.startswith(TOOL_CALL_END):
            self._pending = body[len(TOOL_CALL_END) :]
            self._end_call()
            return True
        if self._in_block and body.startswith(FUNCTION):
            self._pending = body
            self._phase = _Phase.HEADER
            return True
        markers = (TOOL_CALL_END, FUNCTION) if self._in_block else (TOOL_CALL_END,)
        if not finished and any(marker.startswith(body) for marker in markers):
            self._pending = body  # whitespace, or the start of a marker
            return False
        if not self._in_block or not body:
            self._pending = body  # after a bare function, the text goes on as content
            self._end_call()
            return bool(body)
        self._pending = _skip_stray(body)
        return True

    def _end_call(self) -> None:
        self._in_call = False
        self._call_ended()

    # A `<tool_call>` block that is not in the XML format.

    def _scan_raw_block(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        closed = self._pending.find(TOOL_CALL_END)
        if closed < 0 and not finished:
            return False
        body = self._pending if closed < 0 else self._pending[:closed]
        self._pending = "" if closed < 0 else self._pending[closed + len(TOOL_CALL_END) :]
        self._in_call = False
        call = _json_call(body)
        if call is None:
            markup = TOOL_CALL + body + (TOOL_CALL_END if closed >= 0 else "")
            self._emit_text(content, self._space_before_call + markup)
            return True
        name, arguments = call
        index = self._take_index()
        calls.extend(
            [ToolCallDelta(index, new_tool_call_id(), name, ""), ToolCallDelta(index, arguments=arguments)]
        )
        self._call_ended()
        return True


def _first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(offset, marker) of the first of `markers` in `text`, or (-1, "")."""
    best, which = -1, ""
    for marker in markers:
        found = text.find(marker)
        if found >= 0 and (best < 0 or found < best):
            best, which = found, marker
    return best, which


def _find_any(text: str, chars: str, start: int) -> int:
    """Offset of the first of `chars` in `text` from `start`, or -1."""
    found = [offset for offset in (text.find(char, start) for char in chars) if offset >= 0]
    return min(found) if found else -1


def _followed_by(text: str, position: int, markers: tuple[str, ...], finished: bool) -> bool | None:
    """Whether `text` goes on from `position`, after whitespace, with one of `markers` or ends there;
    None while the text so far cannot tell."""
    rest = text[position:].lstrip(WHITESPACE)
    if not rest:
        return True if finished else None
    if rest.startswith(markers):
        return True
    if not finished and any(marker.startswith(rest) for marker in markers):
        return None
    return False


def _skip_stray(text: str) -> str:
    """`text` from its next `<` after the first character (stray text inside a call is dropped)."""
    found = text.find("<", 1)
    return text[found:] if found >= 0 else ""


def _json_call(body: str) -> tuple[str, str] | None:
    """A hermes-style `{"name": ..., "arguments": {...}}` block -> (name, arguments JSON), else None."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return call["name"], text
