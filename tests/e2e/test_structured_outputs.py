"""Structured outputs on the live server (the default model, SmolLM2-135M-Instruct, on the CPU) through
the openai SDK: JSON schemas (every output parses and validates), parse() into a Pydantic model, regex,
choice, json_object, tool_choice required / named, the same streamed, and bad input as 400s.

Greedy decoding and bounded schemas (maxLength, maxItems) keep every answer short, so the requests
finish (finish_reason "stop") well within max_tokens; they run concurrently, as a batch."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import API_KEY, LiveServer

pytestmark = pytest.mark.e2e

MAX_TOKENS = 160
STR = {"type": "string", "maxLength": 16}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a city", obj({"city": STR, "country": STR, "population": {"type": "integer", "minimum": 0}})),
    ("a book", obj({"title": STR, "author": obj({"first": STR, "last": STR})})),
    ("three colours", obj({"colours": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}})),
    ("a traffic light", obj({"state": {"type": "string", "enum": ["red", "amber", "green"]}})),
    ("a light switch", obj({"on": {"type": "boolean"}, "watts": {"type": "number"}})),
    (
        "two pets",
        obj(
            {
                "pets": {
                    "type": "array",
                    "items": obj({"name": STR, "legs": {"type": "integer"}}),
                    "maxItems": 2,
                }
            }
        ),
    ),
    ("a user", obj({"id": {"type": "integer"}, "nickname": STR, "admin": {"type": "boolean"}}, ["id"])),
    ("a score", obj({"score": {"type": "integer", "minimum": 1, "maximum": 10}})),
    ("an answer", obj({"answer": {"anyOf": [{"type": "integer"}, STR]}})),
    ("a version", obj({"kind": {"const": "version"}, "major": {"type": "integer", "minimum": 0}})),
    (
        "a small grid",
        obj(
            {
                "rows": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "a point",
        {
            "$defs": {"coord": {"type": "number"}},
            **obj({"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}}),
        },
    ),
    ("a postcode", obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}})),
    ("a list of numbers", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
    ("a maybe-name", obj({"name": {"type": ["string", "null"], "maxLength": 16}})),
    ("an order", obj({"order": obj({"item": obj({"sku": STR, "qty": {"type": "integer", "minimum": 1}})})})),
    (
        "a weather report",
        obj(
            {
                "city": STR,
                "temperature_c": {"type": "number"},
                "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]},
                "windy": {"type": "boolean"},
            },
            ["city", "sky"],
        ),
    ),
    ("a word", {"type": "string", "maxLength": 12}),
    (
        "tags",
        obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    ),
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": obj({"city": STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": obj({"a": {"type": "integer"}, "b": {"type": "integer"}}),
        },
    },
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with {what} as JSON."}]


def json_schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_twenty_json_schemas_validate(client: openai.OpenAI) -> None:
    def run(item: tuple[str, dict[str, Any]]) -> Any:
        what, schema = item
        return client.chat.completions.create(
            model="smol",
            messages=ask(what),
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=json_schema_format(schema),
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        responses = list(pool.map(run, SCHEMAS))
    for (what, schema), response in zip(SCHEMAS, responses, strict=True):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", (what, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_guided_json_and_structured_outputs_fields(client: openai.OpenAI) -> None:
    schema = SCHEMAS[0][1]
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        response = client.chat.completions.create(
            model="smol", messages=ask("a person"), max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        jsonschema.validate(json.loads(response.choices[0].message.content), schema)


class Colour(BaseModel):
    name: str = Field(max_length=16)
    hex: str = Field(pattern="^#[0-9a-f]{6}$")


class Palette(BaseModel):
    title: str = Field(max_length=16)
    colours: list[Colour] = Field(max_length=3)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="smol", messages=ask("a palette"), max_tokens=MAX_TOKENS, temperature=0, response_format=Palette
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Palette) and all(isinstance(c, Colour) for c in parsed.colours)


def test_json_object_on_both_routes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give a JSON object for a cat: name and age."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(
        model="smol",
        prompt="Reply with a person as JSON.",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{1,20}\.", r"[A-Z][a-z]{2,8}", r"#[0-9a-f]{6}"]


def test_regex_outputs_fullmatch(client: openai.OpenAI) -> None:
    def run(pattern: str) -> str:
        response = client.completions.create(
            model="smol",
            prompt="Answer:",
            max_tokens=40,
            temperature=0.7,
            seed=1,
            extra_body={"guided_regex": pattern},
        )
        assert response.choices[0].finish_reason == "stop"
        return response.choices[0].text

    with ThreadPoolExecutor(len(REGEXES)) as pool:
        texts = list(pool.map(run, REGEXES))
    for pattern, text in zip(REGEXES, texts, strict=True):
        assert re.fullmatch(pattern, text), (pattern, text)


def test_choice_outputs_are_one_of_the_choices(client: openai.OpenAI) -> None:
    choices = ["positive", "negative", "neutral"]
    response = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
        max_tokens=10,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert [c.message.content in choices for c in response.choices] == [True] * 3


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert required.choices[0].finish_reason == "tool_calls"
    check_calls(required.choices[0].message.tool_calls, set(PARAMETERS))
    named = client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    calls = named.choices[0].message.tool_calls
    check_calls(calls, {"add"})
    assert len(calls) == 1


def stream_text_and_calls(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    text, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return text, calls, finish


def test_streaming_json_schema_and_tool_calls(client: openai.OpenAI) -> None:
    what, schema = SCHEMAS[6]
    whole = client.chat.completions.create(
        model="smol",
        messages=ask(what),
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=json_schema_format(schema),
    )
    text, _, finish = stream_text_and_calls(
        client.chat.completions.create(
            model="smol",
            messages=ask(what),
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=json_schema_format(schema),
            stream=True,
        )
    )
    assert finish == "stop" and text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)

    # parallel_tool_calls false: one call (maxItems 1), which this small model would otherwise repeat
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    for tool_choice, names in (
        ("required", set(PARAMETERS)),
        ({"type": "function", "function": {"name": "add"}}, {"add"}),
    ):
        _, calls, finish = stream_text_and_calls(
            client.chat.completions.create(
                model="smol",
                messages=messages,
                tools=TOOLS,
                tool_choice=tool_choice,
                max_tokens=MAX_TOKENS,
                temperature=0,
                parallel_tool_calls=False,
                stream=True,
            )
        )
        assert finish == "tool_calls" and len(calls) == 1
        for call in calls.values():
            assert call["name"] in names
            jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


BAD_REQUESTS = [
    (
        {"response_format": json_schema_format({"type": "nonsense"})},
        "response_format",
        'Unsupported type "nonsense"',
    ),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "The parenthesis is not closed"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "choice is an empty list"),
    (
        {"extra_body": {"guided_grammar": "root ::= missing"}},
        "guided_grammar",
        'Rule "missing" is not defined',
    ),
    (
        {"response_format": json_schema_format({"type": "object", "not": {"required": ["a"]}})},
        "response_format",
        "uses 'not' at #",
    ),
    (
        {"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}},
        "guided_choice",
        "asks for 2 output constraints (guided_regex, guided_choice)",
    ),
    (
        {"extra_body": {"guided_decoding_backend": "outlines", "guided_regex": "a"}},
        "guided_decoding_backend",
        "xgrammar",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
        "tool_choice",
        "tool_choice names the function 'missing', which is not in tools",
    ),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD_REQUESTS)
def test_bad_input_is_400_naming_the_problem(
    client: openai.OpenAI, fields: dict, param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="smol", messages=ask("x"), max_tokens=8, **fields)
    error = raised.value.body
    assert message in error["message"] and error["param"] == param, error
