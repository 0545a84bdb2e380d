"""Per-choice output parsing of the chat route: the reasoning parser first, the tool-call parser on
what remains, in the same order for streamed deltas and for whole outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from fitserve.server.parsers import ReasoningParser, ToolCall, ToolCallDelta, ToolParser


@dataclass
class ParsedDelta:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.called_tools = False

    def feed(self, delta: str, finished: bool) -> ParsedDelta:
        parsed = ParsedDelta(content=delta or None)
        if self.reasoning is not None:
            split = self.reasoning.feed(delta, finished)
            parsed.reasoning, parsed.content = split.reasoning, split.content
        if self.tools is not None:
            found = self.tools.feed(parsed.content or "", finished)
            parsed.content, parsed.tool_calls = found.content, found.tool_calls
            self.called_tools = self.called_tools or bool(found.tool_calls)
        return parsed

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content or ""
        calls: list[ToolCall] = []
        if self.tools is not None:
            found = self.tools.parse(content)
            content, calls = found.content or "", found.tool_calls
            self.called_tools = bool(calls)
        return ParsedMessage(reasoning, content or None if (reasoning or calls) else content, calls)


def final_finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI reports a turn that ended in tool calls as finish_reason "tool_calls"."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason
