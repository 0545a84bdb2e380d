"""What a tool-call parser returns, streamed and whole, and the base every parser follows.

One parser instance serves one choice of one request. `feed(delta, finished)` reads the text a delta
at a time and returns the content that can be shown now plus tool-call fragments in OpenAI's stream
shape (the first fragment of a call carries its id and name, later ones append to its arguments).
`parse(text)` runs a fresh machine over the whole output, so both paths always agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    index: int  # position of the call in the message's tool_calls
    id: str | None = None  # set on the first fragment of a call only
    name: str | None = None  # set on the first fragment of a call only
    arguments: str | None = None  # appended to the call's arguments


@dataclass
class ToolParseDelta:
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]


class ToolParser:
    name: ClassVar[str] = ""
    # The format's markers are special tokens: the server decodes special tokens into the text while
    # this parser handles a request.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._pending = ""  # text not yet emitted
        self._in_call = False

    def feed(self, delta: str, finished: bool) -> ToolParseDelta:
        """Appends `delta` to the text held back, then alternates the two scans (the text between calls,
        a call) while either makes progress; a format parser keeps `_pending` and `_in_call` and defines
        `_scan_text(content, finished)` and `_scan_call(content, tool_calls, finished)`, each returning
        whether it consumed something. `_on_finished` may trim the held text once the output ends."""
        self._pending += delta
        if finished:
            self._pending = self._on_finished(self._pending)
        result = ToolParseDelta()
        content: list[str] = []
        progressing = True
        while progressing:
            if self._in_call:
                progressing = self._scan_call(content, result.tool_calls, finished)
            else:
                progressing = self._scan_text(content, finished)
        result.content = "".join(content) or None
        return result

    def _on_finished(self, pending: str) -> str:
        return pending

    def _scan_text(self, content: list[str], finished: bool) -> bool:
        raise NotImplementedError

    def _scan_call(self, content: list[str], tool_calls: list[ToolCallDelta], finished: bool) -> bool:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedToolCalls:
        whole = type(self)(self.tools).feed(text, finished=True)
        calls: dict[int, ToolCall] = {}
        for fragment in whole.tool_calls:
            call = calls.get(fragment.index)
            if call is None:
                call = calls[fragment.index] = ToolCall(
                    id=fragment.id or new_tool_call_id(), name="", arguments=""
                )
            call.name = fragment.name if fragment.name is not None else call.name
            call.arguments += fragment.arguments or ""
        return ParsedToolCalls(content=whole.content, tool_calls=[calls[i] for i in sorted(calls)])
