"""`--tool-call-parser qwen3_coder` on Qwen3-Coder / Qwen3.5 / Qwen3.6 style outputs: whole outputs, the same
outputs streamed a character at a time, cut in two at every offset and fed in random pieces, typed values
per tool schema, and malformed markup."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from fitserve.server.args import ServerSettings, add_server_args
from fitserve.server.parsers import TOOL_CALL_PARSERS
from fitserve.server.parsers.qwen3_coder import Qwen3CoderToolParser
from fitserve.server.parsers.qwen3_coder_values import convert_value, declared_type
from tests.unit.test_server_parsers import feed_in_pieces

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
RUN_TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "verbose": {"type": "boolean"},
                "options": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "note": {"type": ["string", "null"]},
                "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            },
        },
    },
}
NO_SCHEMA_TOOL = {"type": "function", "function": {"name": "ping", "parameters": None}}
TOOLS = [WEATHER_TOOL, RUN_TOOL, NO_SCHEMA_TOOL]


def call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder writes it: each value between new lines."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = 'def f(x):\n    return "</parameter>" if x else {"a": 1}\n\n'
# name -> (model output, content, [(tool name, arguments)])
CASES: dict[str, tuple[str, str | None, list[tuple[str, dict]]]] = {
    "one call": (
        call("get_weather", city="Paris", days="3"),
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "two calls": (
        call("get_weather", city="Paris", days="3") + "\n" + call("get_weather", city="Rome"),
        None,
        [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})],
    ),
    "text before a call": (
        "I will check the weather.\n\n" + call("get_weather", city="Oslo"),
        "I will check the weather.",
        [("get_weather", {"city": "Oslo"})],
    ),
    "text around calls": (
        "First <b>bold</b> text\n"
        + call("get_weather", city="A")
        + "\n\nbetween\n"
        + call("ping")
        + "\nafter",
        "First <b>bold</b> textbetweenafter",
        [("get_weather", {"city": "A"}), ("ping", {})],
    ),
    "typed values": (
        call(
            "run",
            code=CODE,
            count="42",
            ratio="2.5",
            verbose="True",
            options='{"depth": 2, "mode": "fast"}',
            tags='["a", "b"]',
            note="line one\nline two",
            limit="None",
        ),
        None,
        [
            (
                "run",
                {
                    "code": CODE,
                    "count": 42,
                    "ratio": 2.5,
                    "verbose": True,
                    "options": {"depth": 2, "mode": "fast"},
                    "tags": ["a", "b"],
                    "note": "line one\nline two",
                    "limit": None,
                },
            )
        ],
    ),
    "values not of their type stay strings": (
        call("run", count="many", ratio="1e999", verbose="yes", options="{broken", note="null"),
        None,
        [("run", {"count": "many", "ratio": "1e999", "verbose": "yes", "options": "{broken", "note": None})],
    ),
    "unknown schema: JSON, else the string": (
        call("ping", n="7", flag="false", obj='{"k": [1]}', word="hello", py="True", quoted='"x"')
        + call("not_declared", size="1.5", text="two words")
        + call("get_weather", city="Paris", extra="[1, 2]"),
        None,
        [
            ("ping", {"n": 7, "flag": False, "obj": {"k": [1]}, "word": "hello", "py": True, "quoted": "x"}),
            ("not_declared", {"size": 1.5, "text": "two words"}),
            ("get_weather", {"city": "Paris", "extra": [1, 2]}),
        ],
    ),
    "several functions in one block": (
        "<tool_call>\n<function=ping>\n</function>\n<function=get_weather>\n<parameter=city>\nX\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [("ping", {}), ("get_weather", {"city": "X"})],
    ),
    "a function without <tool_call>": (
        "Calling.\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\nDone.",
        "Calling.Done.",
        [("get_weather", {"city": "Lima"})],
    ),
    "compact markup": (
        "<tool_call><function=get_weather><parameter=city>Kyiv</parameter><parameter=days>2</parameter>"
        "</function></tool_call>",
        None,
        [("get_weather", {"city": "Kyiv", "days": 2})],
    ),
    "a value without </parameter>": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</function>\n</tool_call>",
        None,
        [("get_weather", {"city": "Bern"})],
    ),
    "cut off inside a value": (
        "<tool_call>\n<function=run>\n<parameter=count>\n3\n</parameter>\n<parameter=code>\nprint(",
        None,
        [("run", {"count": 3, "code": "print("})],
    ),
    "cut off after a parameter": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRiga\n</parameter>\n",
        None,
        [("get_weather", {"city": "Riga"})],
    ),
    "a hermes-style block": (
        'Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>',
        "Hi",
        [("get_weather", {"city": "Nice"})],
    ),
    "empty string and unicode": (
        call("get_weather", city="", days="1") + call("get_weather", city="Zürich 東京 \\ \t"),
        None,
        [("get_weather", {"city": "", "days": 1}), ("get_weather", {"city": "Zürich 東京 \\ \t"})],
    ),
}
MALFORMED: dict[str, tuple[str, str]] = {  # name -> (model output, content): no call, the text as written
    "not a function": ("Sure <tool_call>not xml</tool_call> ok", "Sure <tool_call>not xml</tool_call> ok"),
    "unterminated block": ("Sure <tool_call>\n", "Sure <tool_call>\n"),
    "unterminated header": ("Sure\n<tool_call>\n<function=get_wea", "Sure\n<tool_call>\n<function=get_wea"),
    "header broken by a new line": (
        "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>",
    ),
    "empty function name": (
        "<tool_call><function=></function></tool_call>",
        "<tool_call><function=></function></tool_call>",
    ),
    "bare header without a name": ("a <function=> b", "a <function=> b"),
    "partial opening marker": ("Look: <tool_ca", "Look: <tool_ca"),
    "partial bare marker": ("x <functio", "x <functio"),
    "a marker-like tag": ("<tool_callx> and <function_x>", "<tool_callx> and <function_x>"),
}


def collect(parser: Qwen3CoderToolParser, pieces: list[str]) -> tuple[str, dict[int, dict[str, str]], list]:
    """Feeds `pieces`; returns (content, calls by index, every delta)."""
    content, calls, deltas = "", {}, []
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, i == len(pieces) - 1)
        deltas.append(delta)
        content += delta.content or ""
        for fragment in delta.tool_calls:
            entry = calls.setdefault(fragment.index, {"id": "", "name": "", "arguments": "", "headers": 0})
            if fragment.id is not None:
                entry["headers"] += 1
                assert fragment.name is not None and fragment.arguments == ""
            else:
                assert fragment.name is None
            entry["id"] += fragment.id or ""
            entry["name"] += fragment.name or ""
            entry["arguments"] += fragment.arguments or ""
    return content, calls, deltas


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = Qwen3CoderToolParser(TOOLS).parse(text)
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def assert_stream_matches(text: str, pieces: list[str]) -> None:
    content, expected_calls = whole(text)
    streamed, calls, _ = collect(Qwen3CoderToolParser(TOOLS), pieces)
    assert streamed == (content or ""), pieces
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected_calls, pieces
    assert sorted(calls) == list(range(len(calls)))
    for entry in calls.values():
        assert entry["headers"] == 1 and entry["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_output(name: str) -> None:
    text, content, expected = CASES[name]
    parsed = Qwen3CoderToolParser(TOOLS).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == expected
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_a_character_at_a_time(name: str) -> None:
    text = CASES[name][0]
    assert_stream_matches(text, list(text))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cut_in_two_at_every_offset(name: str) -> None:
    text = CASES[name][0]
    for cut in range(len(text) + 1):
        assert_stream_matches(text, [text[:cut], text[cut:]])


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_in_random_pieces(name: str) -> None:
    text, content, expected = CASES[name]
    for seed in range(25):
        rng = random.Random(seed)
        pieces, position = [], 0
        while position < len(text):
            size = rng.choice([1, 2, 3, 5, 8, 13, 40])
            pieces.append(text[position : position + size])
            position += size
        assert_stream_matches(text, pieces)
    _, streamed_content, calls = feed_in_pieces(Qwen3CoderToolParser(TOOLS), text, seed=7)
    assert streamed_content == (content or "")
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == expected


@pytest.mark.parametrize("name", ["one call", "two calls", "text before a call", "typed values"])
def test_no_markup_reaches_the_content_while_streaming(name: str) -> None:
    text = CASES[name][0]
    _, _, deltas = collect(Qwen3CoderToolParser(TOOLS), list(text))
    assert not any("<" in (delta.content or "") or ">" in (delta.content or "") for delta in deltas)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_markup_is_content(name: str) -> None:
    text, content = MALFORMED[name]
    parsed = Qwen3CoderToolParser(TOOLS).parse(text)
    assert (parsed.content, parsed.tool_calls) == (content, [])
    for pieces in (list(text), [text]):
        streamed, calls, _ = collect(Qwen3CoderToolParser(TOOLS), pieces)
        assert (streamed, calls) == (content, {})


def test_header_then_string_arguments_stream_as_they_come() -> None:
    parser = Qwen3CoderToolParser(TOOLS)
    first = parser.feed("Running it.\n<tool_call>\n<function=run>\n<parameter=code>\nprint(1)\npri", False)
    assert first.content == "Running it."
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [
        (0, "run", ""),
        (0, None, '{"code": "print(1)\\npri'),
    ]
    # The new line before a possible closing tag is held back, and so is the tag itself.
    second = parser.feed("nt(2)\n</param", False)
    assert [c.arguments for c in second.tool_calls] == ["nt(2)"]
    third = parser.feed("eter>\n<parameter=count>\n4", False)  # the code's end is known: a parameter follows
    assert [c.arguments for c in third.tool_calls] == ['"']
    fourth = parser.feed("\n</parameter>\n</function>\n</tool_call>", True)
    assert [c.arguments for c in fourth.tool_calls] == [', "count": 4', "}"]
    assert fourth.content is None


def test_a_closing_tag_inside_a_value_waits_for_what_follows() -> None:
    parser = Qwen3CoderToolParser(TOOLS)
    parser.feed("<tool_call><function=run><parameter=code>a</parameter>", False)
    literal = parser.feed(" b", False)  # not followed by a marker: the tag was text of the code
    assert [c.arguments for c in literal.tool_calls] == ["</parameter> b"]
    end = parser.feed("</parameter></function></tool_call>", True)
    assert [c.arguments for c in end.tool_calls] == ['"', "}"]


def test_fuzzed_markup_never_crashes_and_streams_like_whole() -> None:
    atoms = [
        "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=run>", "<function=",
        "</function>", "<parameter=city>", "<parameter=count>", "<parameter=code>", "<parameter=",
        "</parameter>", "\n", " ", "<", ">", "=", "Paris", "12", '{"a": 1}', "text", "<tool_", "</para",
        "</func",
    ]  # fmt: skip
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 25)))
        _, expected_calls = whole(text)
        for arguments in (a for _, a in expected_calls):
            json.loads(arguments)
        assert_stream_matches(text, list(text))
        cut = rng.randint(0, len(text))
        assert_stream_matches(text, [text[:cut], text[cut:]])


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        (" -7\n", {"type": "int"}, -7),
        ("4.0", {"type": "integer"}, "4.0"),
        ("3", {"type": "number"}, 3),
        ("-0.25", {"type": "number"}, -0.25),
        ("1e3", {"type": "float"}, 1000.0),
        ("nan", {"type": "number"}, "nan"),
        ("TRUE", {"type": "boolean"}, True),
        ("False", {"type": "bool"}, False),
        ("null", {"type": "integer"}, None),
        ("None", {"type": "object"}, None),
        ("null", {"type": "string"}, "null"),
        ("None", {"type": ["string", "null"]}, None),
        ("None", {"type": "string", "nullable": True}, None),
        ("{'a': (1, 2), 'b': None}", {"type": "object"}, {"a": [1, 2], "b": None}),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),
        ("[1, NaN]", {"type": "array"}, "[1, NaN]"),
        ("  spaced  ", {"type": "string"}, "  spaced  "),
        ("5", {"anyOf": [{"type": "null"}, {"type": "integer"}]}, 5),
        ("5", {"enum": ["5", "6"]}, 5),
        ("5", None, 5),
        ("Infinity", None, "Infinity"),
        ("None", None, None),
        ("a: b", {"type": "object"}, "a: b"),
    ],
)
def test_values_are_read_by_schema(raw: str, schema: dict | None, value: object) -> None:
    converted = convert_value(raw, schema)
    assert converted == value and type(converted) is type(value)


def test_declared_types() -> None:
    assert declared_type({"type": "string"}) == ("string", False)
    assert declared_type({"type": ["null", "integer"]}) == ("integer", True)
    assert declared_type({"oneOf": [{"type": "array"}, {"type": "null"}]}) == ("array", True)
    assert declared_type({"type": "null"}) == ("null", True)
    assert declared_type({"$ref": "#/defs/x"}) == (None, False)
    assert declared_type("string") == (None, False)


def test_selected_by_the_tool_call_parser_flag() -> None:
    assert TOOL_CALL_PARSERS["qwen3_coder"] is Qwen3CoderToolParser
    assert not Qwen3CoderToolParser.keeps_special_tokens  # <tool_call> decodes with special tokens skipped
    parser = add_server_args(argparse.ArgumentParser())
    flags = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
    settings = ServerSettings.from_namespace(parser.parse_args(flags))
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("qwen3_coder", "qwen3")


def test_tools_without_parameters_or_malformed_tools() -> None:
    odd_tools = [
        {"type": "function"},
        {"function": {"name": 3}},
        {"function": {"name": "f", "parameters": []}},
    ]
    parsed = Qwen3CoderToolParser(odd_tools).parse(call("f", a="1", b="x"))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"a": 1, "b": "x"})]
    assert Qwen3CoderToolParser(None).parse(call("g")).tool_calls[0].arguments == "{}"
