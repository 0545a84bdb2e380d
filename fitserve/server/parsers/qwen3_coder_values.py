"""Qwen3-Coder's parameter values, read into the JSON types the request's tool schemas declare.

The `<parameter=NAME>` blocks of a Qwen3-Coder call hold raw text, not JSON: the model writes what its
chat template renders for an argument (strings as they are, objects and lists as JSON, other values
as Jinja prints them: `3`, `2.5`, `True`, `None`). The type comes from the schema of that parameter in
the request's `tools` (`parameters.properties.NAME.type`, a list of types, or the types of an
`anyOf`/`oneOf`), read as vLLM's qwen3_coder parser reads it:

- a string type (`string`, also `str`, `text`, `char`, `varchar`, `enum`): the text unchanged;
- `integer` (`int*`, `uint*`, `long`, `short`, `unsigned`): an integer, `number` (`num*`, `float*`,
  `double`, `decimal`): an integer or a float as written, `boolean` (`bool`, `binary`): `true` /
  `false` in any case; `object` / `array` (`dict*`, `list*`, `arr`): JSON, else a Python literal
  (`{'a': 1}`) that has a JSON form;
- `null` or `None` (any case) is null for every type but a string one, and for a string one when the
  schema also allows null;
- a text that is not of its declared type stays a string (vLLM reads a bad boolean as false);
- no schema for the parameter (the tool or the parameter is not declared, or declares no type): JSON
  when the text is JSON (`3`, `true`, `[1, 2]`, `"quoted"`), `True` / `False` / `None` as Python
  prints them, else the string (vLLM keeps an undeclared parameter a string).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NULL_WORDS = ("null", "none")
_PYTHON_WORDS = {"True": True, "False": False, "None": None}
_STRING_NAMES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOLEAN_NAMES = frozenset({"boolean", "bool", "binary"})


def tool_properties(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's name -> the `properties` of its parameter schema ({} when it declares none)."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found[function["name"]] = properties if isinstance(properties, dict) else {}
    return found


def declared_type(schema: Any) -> tuple[str | None, bool]:
    """(the parameter's type as one of string, integer, number, boolean, object, array, null, or None
    when it declares none this reader knows; whether it allows null)."""
    if not isinstance(schema, dict):
        return None, False
    names: list[str] = []
    declared = schema.get("type")
    if isinstance(declared, str):
        names.append(declared)
    elif isinstance(declared, list):
        names.extend(name for name in declared if isinstance(name, str))
    if not names:
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            for option in options if isinstance(options, list) else []:
                if isinstance(option, dict) and isinstance(option.get("type"), str):
                    names.append(option["type"])
    kinds = [_kind(name) for name in names]
    nullable = schema.get("nullable") is True or "null" in kinds
    primary = next((kind for kind in kinds if kind not in (None, "null")), None)
    if primary is None and "null" in kinds:
        primary = "null"
    return primary, nullable


def _kind(name: str) -> str | None:
    name = name.strip().lower()
    if name in _STRING_NAMES:
        return "string"
    if name in _BOOLEAN_NAMES:
        return "boolean"
    if name == "null":
        return "null"
    if name.startswith(("int", "uint", "long", "short", "unsigned")):
        return "integer"
    if name.startswith(("num", "float", "double", "decimal")):
        return "number"
    if name == "object" or name.startswith("dict"):
        return "object"
    if name in ("array", "arr") or name.startswith("list"):
        return "array"
    return None


def convert_value(raw: str, schema: Any) -> Any:
    """The JSON value of a parameter's raw text under its schema (None: no schema)."""
    kind, nullable = declared_type(schema)
    text = raw.strip()
    if nullable and text.lower() in _NULL_WORDS:
        return None
    if kind == "string":
        return raw
    if kind is None:
        return _guess(raw, text)
    if text.lower() in _NULL_WORDS:
        return None
    if kind == "integer":
        return int(text) if _INTEGER.fullmatch(text) else raw
    if kind == "number":
        return _number(raw, text)
    if kind == "boolean":
        lowered = text.lower()
        return lowered == "true" if lowered in ("true", "false") else raw
    if kind in ("object", "array"):
        return _container(raw, text)
    return raw  # "null" alone, and the text is not null


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} has no JSON form")


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return False, None


def _guess(raw: str, text: str) -> Any:
    ok, value = _json(text)
    if ok:
        return value
    if text in _PYTHON_WORDS:
        return _PYTHON_WORDS[text]
    return raw


def _number(raw: str, text: str) -> Any:
    if _INTEGER.fullmatch(text):
        return int(text)
    if not _NUMBER.fullmatch(text):
        return raw
    value = float(text)
    return value if math.isfinite(value) else raw


def _container(raw: str, text: str) -> Any:
    ok, value = _json(text)
    if ok:
        return value
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw
    if not isinstance(value, (dict, list, tuple)):
        return raw
    try:  # a Python literal becomes JSON only when every part has a JSON form (no sets, bytes, NaN)
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        return raw
