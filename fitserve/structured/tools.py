"""tool_choice "required" and a named function as structured outputs (vLLM's approach): the output is
held to a JSON array of {"name", "parameters"} objects, one per call, each valid for its tool's
parameter schema ("required"), or to the named function's parameters object; the server builds the
tool calls from that JSON itself (fitserve/server/parsers/forced_tools.py), whatever the
--tool-call-parser."""

from __future__ import annotations

from typing import Any

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = (tool.get("function") or {}).get("parameters")
    return parameters if parameters else dict(_ANY_OBJECT)


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [(tool.get("function") or {}).get("name", "") for tool in tools]


def required_tools_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """An array of one or more calls, each {"name": a tool's name, "parameters": its arguments};
    exactly one call when `parallel` is false (OpenAI's parallel_tool_calls)."""
    if not tools:
        raise ValueError('tool_choice "required" needs tools: add the tools the model may call')
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, tool in zip(tool_names(tools), tools)
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_tool_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The parameters schema of the function `name` (ValueError naming it when no tool has it)."""
    for tool_name, tool in zip(tool_names(tools), tools):
        if tool_name == name:
            return _parameters(tool)
    offered = ", ".join(repr(n) for n in tool_names(tools)) or "none"
    raise ValueError(
        f"tool_choice names the function {name!r}, which is not in tools (offered: {offered}): name one of "
        "the request's tools, or add it to tools"
    )
