"""Chat output parsers: reasoning (`--reasoning-parser`) and tool calls (`--tool-call-parser`)."""

from __future__ import annotations

from fitserve.server.parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from fitserve.server.parsers.gemma4_reasoning import Gemma4ReasoningParser
from fitserve.server.parsers.gemma4_tool import Gemma4ToolParser
from fitserve.server.parsers.hermes import HermesToolParser
from fitserve.server.parsers.qwen3 import Qwen3ReasoningParser
from fitserve.server.parsers.qwen3_coder import Qwen3CoderToolParser
from fitserve.server.parsers.reasoning import ReasoningDelta, ReasoningParser
from fitserve.server.parsers.tool_calls import (
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParseDelta,
    ToolParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Gemma4ReasoningParser.name: Gemma4ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}

TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    Gemma4ToolParser.name: Gemma4ToolParser,
    HermesToolParser.name: HermesToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ParsedToolCalls",
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParseDelta",
    "ToolParser",
]
