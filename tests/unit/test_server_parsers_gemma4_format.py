"""Gemma-4's argument syntax (gemma4_format.parse_call) and the marker helpers the gemma4 parsers use."""

from __future__ import annotations

import json

import pytest

from fitserve.server.parsers.gemma4_format import bare_value, parse_call
from fitserve.server.parsers.text_scan import drop_end_marker, marker_suffix_len

Q = '<|"|>'


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("false", False),
        ("None", None),
        ("null", None),
        ("42", 42),
        ("-7", -7),
        ("0.5", 0.5),
        ("1e-05", 1e-05),
        ("-2.5E+3", -2500.0),
        ("007", "007"),  # not a JSON number: kept as written
        ("True", "True"),  # the template prints booleans lower-case; anything else is text
        ("celsius", "celsius"),
    ],
)
def test_bare_values(text: str, value: object) -> None:
    parsed = bare_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_call_with_every_kind_of_value() -> None:
    body = (
        f'call:book_flight{{from:{Q}OSL{Q},passengers:[{{age:34,name:{Q}Kari "K" Nordmann{Q}}}],'
        f"return:None,seats:2,window:true}}"
    )
    name, arguments = parse_call(body)
    assert name == "book_flight"
    assert arguments == {
        "from": "OSL",
        "passengers": [{"age": 34, "name": 'Kari "K" Nordmann'}],
        "return": None,
        "seats": 2,
        "window": True,
    }


def test_strings_are_literal_to_the_next_delimiter() -> None:
    text = 'a\\nb "c" {d}, [e]: f\n\tg'
    name, arguments = parse_call(f"call:echo{{text:{Q}{text}{Q}}}")
    assert arguments == {"text": text}
    assert json.loads(json.dumps(arguments)) == {"text": text}


def test_whitespace_between_tokens_is_allowed() -> None:
    body = " call:f { a : 1 , b : [ " + Q + "x" + Q + " , 2 ] } "
    assert parse_call(body) == ("f", {"a": 1, "b": ["x", 2]})


@pytest.mark.parametrize(
    "body",
    [
        "",  # nothing
        "get_weather{}",  # no "call:" prefix
        "call:{}",  # no name
        "call:get weather{}",  # a name with a space
        "call:f(x=1)",  # Python-style call
        "call:f{a 1}",  # key without ':'
        "call:f{a:}",  # value missing
        f"call:f{{a:{Q}x}}",  # string never closed
        "call:f{a:1",  # object never closed
        "call:f{a:[1,2}",  # list closed by '}'
        "call:f{a:1 b:2}",  # missing ','
        "call:f{a:1}trailing",  # text after the arguments
        f"call:f{{a:1{Q}x{Q}}}",  # a value running into a string
        '{"name": "f", "arguments": {}}',  # the hermes format is not Gemma-4's
    ],
)
def test_malformed_calls_are_refused(body: str) -> None:
    assert parse_call(body) is None


def test_marker_helpers() -> None:
    markers = ("<turn|>", "<|tool_response>")
    assert marker_suffix_len("Paris.<turn|>", markers) == len("<turn|>")  # a whole marker is held too
    assert marker_suffix_len("Paris.<|tool_res", markers) == len("<|tool_res")
    assert marker_suffix_len("Paris.<", markers) == 1
    assert marker_suffix_len("Paris.", markers) == 0
    assert drop_end_marker("Paris.<turn|>", markers) == "Paris."
    assert drop_end_marker("<turn|> then text", markers) == "<turn|> then text"
