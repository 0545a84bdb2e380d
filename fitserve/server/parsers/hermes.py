"""`--tool-call-parser hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

The format of Hermes, Qwen2.5 and Qwen3 models. Text outside the blocks is content (whitespace that
only separates blocks is dropped). While a block streams, the call's name is sent as soon as the
`{"name": "...", "arguments":` header is complete, then the arguments text as it arrives, holding back
a tail that may still turn out to be the object's closing brace or the closing tag. A block whose
header is written differently is sent whole once it closes; one that is not a JSON object with a
string `name` is passed through as content.
"""

from __future__ import annotations

import json
import re

from fitserve.server.parsers.tagged_calls import WHITESPACE, TaggedToolParser
from fitserve.server.parsers.text_scan import partial_tag_suffix_len
from fitserve.server.parsers.tool_calls import ToolCallDelta, new_tool_call_id

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesToolParser(TaggedToolParser):
    name = "hermes"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._call_index = -1  # index of the streaming call whose header was sent, else -1
        self._args_start = 0  # offset of the arguments text inside the block
        self._args_sent = 0

    def _scan_text(self, content: list[str], finished: bool) -> bool:
        opened = self._pending.find(_OPEN)
        if opened >= 0:
            self._emit_text(content, self._pending[:opened].rstrip(WHITESPACE))
            self._pending = self._pending[opened + len(_OPEN) :]
            self._in_call, self._call_index = True, -1
            return True
        return self._emit_text_holding(content, finished, partial_tag_suffix_len(self._pending, _OPEN))

    def _scan_call(self, content: list[str], calls: list[ToolCallDelta], finished: bool) -> bool:
        closed = self._pending.find(_CLOSE)
        body = self._pending if closed < 0 else self._pending[:closed]
        ends = closed >= 0 or finished
        if self._call_index < 0:
            header = _HEADER.match(body)
            if header is not None:
                self._call_index = self._take_index()
                name = json.loads(f'"{header.group(1)}"')
                calls.append(ToolCallDelta(self._call_index, new_tool_call_id(), name, ""))
                self._args_start, self._args_sent = header.end(), 0
            elif ends:
                self._emit_whole_block(body, closed >= 0, content, calls)
        if self._call_index >= 0:
            self._stream_arguments(body[self._args_start :], ends, calls)
        if not ends:
            return False
        self._pending = self._pending[closed + len(_CLOSE) :] if closed >= 0 else ""
        self._in_call = False
        self._call_ended()
        return closed >= 0

    def _stream_arguments(self, region: str, ends: bool, calls: list[ToolCallDelta]) -> None:
        if ends:
            ready = region.rstrip(WHITESPACE)
            ready = ready[:-1].rstrip(WHITESPACE) if ready.endswith("}") else ready
        else:
            ready = region[: len(region) - partial_tag_suffix_len(region, _CLOSE)]
            ready = ready.rstrip(WHITESPACE + "}")
        if len(ready) > self._args_sent:
            calls.append(ToolCallDelta(self._call_index, arguments=ready[self._args_sent :]))
            self._args_sent = len(ready)

    def _emit_whole_block(
        self, body: str, closed: bool, content: list[str], calls: list[ToolCallDelta]
    ) -> None:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", call.get("parameters", {}))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCallDelta(self._take_index(), new_tool_call_id(), call["name"], text))
        else:
            self._emit_text(content, _OPEN + body + (_CLOSE if closed else ""))
