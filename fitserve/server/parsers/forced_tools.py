"""Tool calls of tool_choice "required" and of a named function, read from the JSON the grammar held
the output to (fitserve/structured/tools.py), not from any model's tool-call format:

- required: a JSON array of {"name": ..., "parameters": {...}}, one per call;
- named: the function's arguments object itself.

A named call streams: its first fragment (id, name) comes with the first text, then every delta of text
is a delta of its arguments. A "required" array streams each call once its object is complete in the
text; an output cut by max_tokens keeps the calls completed before the cut. An output with no
complete call is returned as content.
"""

from __future__ import annotations

import json
from typing import Any

from fitserve.server.parsers.tool_calls import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParseDelta,
    ToolParser,
    new_tool_call_id,
)


class NamedToolParser(ToolParser):
    name = "named_tool_choice"

    def __init__(self, tools: list[dict[str, Any]] | None, function_name: str) -> None:
        super().__init__(tools)
        self.function_name = function_name
        self._id: str | None = None

    def feed(self, delta: str, finished: bool) -> ToolParseDelta:
        if not delta:
            return ToolParseDelta()
        if self._id is None:
            self._id = new_tool_call_id()
            return ToolParseDelta(
                tool_calls=[ToolCallDelta(0, id=self._id, name=self.function_name, arguments=delta)]
            )
        return ToolParseDelta(tool_calls=[ToolCallDelta(0, arguments=delta)])

    def parse(self, text: str) -> ParsedToolCalls:
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return ParsedToolCalls(content=text, tool_calls=[])
        call = ToolCall(new_tool_call_id(), self.function_name, json.dumps(arguments, ensure_ascii=False))
        return ParsedToolCalls(content=None, tool_calls=[call])


class RequiredToolsParser(ToolParser):
    name = "required_tool_choice"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._emitted = 0  # calls already streamed
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str, finished: bool) -> ToolParseDelta:
        self._text += delta
        calls = _complete_calls(self._text, self._decoder)
        result = ToolParseDelta()
        for index in range(self._emitted, len(calls)):
            name, arguments = calls[index]
            result.tool_calls.append(
                ToolCallDelta(index, id=new_tool_call_id(), name=name, arguments=arguments)
            )
        self._emitted = len(calls)
        if finished and not self._emitted:
            result.content = self._text or None  # no call could be read: the text as it is
        return result

    def parse(self, text: str) -> ParsedToolCalls:
        """The same calls as feeding the whole text: every complete call of the array (all of them when
        the output finished; those before the cut when it hit max_tokens), else the text as content."""
        calls = _complete_calls(text, json.JSONDecoder())
        if not calls:
            return ParsedToolCalls(content=text or None, tool_calls=[])
        return ParsedToolCalls(
            content=None,
            tool_calls=[ToolCall(new_tool_call_id(), name, arguments) for name, arguments in calls],
        )


def _call(item: Any) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    return item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)


def _complete_calls(text: str, decoder: json.JSONDecoder) -> list[tuple[str, str]]:
    """The calls whose objects are complete in the text of a JSON array written so far."""
    position = _skip_space(text, 0)
    if position >= len(text) or text[position] != "[":
        return []
    position += 1
    calls: list[tuple[str, str]] = []
    while True:
        position = _skip_space(text, position)
        if position >= len(text) or text[position] != "{":
            return calls
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return calls
        call = _call(item)
        if call is None:
            return calls
        calls.append(call)
        position = _skip_space(text, position)
        if position < len(text) and text[position] == ",":
            position += 1


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position
