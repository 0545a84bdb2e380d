"""`--reasoning-parser gemma4` and `--tool-call-parser gemma4` on hand-written Gemma-4 outputs
(tests/unit/fixtures/gemma4_outputs.json): whole outputs, the same outputs fed in random pieces and a
character at a time (markers split across deltas), and both parsers together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitserve.server.choice_parsing import ChoiceParser, final_finish_reason
from fitserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ReasoningDelta
from fitserve.server.parsers.gemma4_reasoning import Gemma4ReasoningParser
from fitserve.server.parsers.gemma4_tool import Gemma4ToolParser
from tests.unit.test_server_parsers import feed_in_pieces

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "gemma4_outputs.json").read_text())
REASONING_CASES = {case["name"]: case for case in FIXTURES["reasoning"]}
TOOL_CASES = {case["name"]: case for case in FIXTURES["tool_calls"]}
Q = '<|"|>'
NO_THINK_PROMPT = "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"


def feed_by_character(parser, text: str) -> tuple[str, str, dict[int, dict[str, str]]]:
    return feed_in_pieces_of(parser, [text[i : i + 1] for i in range(len(text))])


def feed_in_pieces_of(parser, pieces: list[str]) -> tuple[str, str, dict[int, dict[str, str]]]:
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, i == len(pieces) - 1)
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        for call in getattr(delta, "tool_calls", []):
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.name or ""
            entry["arguments"] += call.arguments or ""
    return reasoning, content, calls


def test_both_parsers_are_registered_under_vllms_name() -> None:
    assert REASONING_PARSERS["gemma4"] is Gemma4ReasoningParser
    assert TOOL_CALL_PARSERS["gemma4"] is Gemma4ToolParser
    assert Gemma4ReasoningParser.keeps_special_tokens and Gemma4ToolParser.keeps_special_tokens


@pytest.mark.parametrize("name", sorted(REASONING_CASES))
def test_reasoning_fixture_whole(name: str) -> None:
    case = REASONING_CASES[name]
    split = Gemma4ReasoningParser(case["prompt"]).split(case["text"])
    assert (split.reasoning, split.content) == (case["reasoning"], case["content"])


@pytest.mark.parametrize("name", sorted(REASONING_CASES))
def test_reasoning_fixture_streamed(name: str) -> None:
    case = REASONING_CASES[name]
    expected = (case["reasoning"] or "", case["content"] or "")
    for seed in range(12):
        reasoning, content, _ = feed_in_pieces(Gemma4ReasoningParser(case["prompt"]), case["text"], seed)
        assert (reasoning, content) == expected, seed
    reasoning, content, _ = feed_by_character(Gemma4ReasoningParser(case["prompt"]), case["text"])
    assert (reasoning, content) == expected


@pytest.mark.parametrize("prompt", ["", NO_THINK_PROMPT, "<|turn>system\n<|think|>\n<turn|>\n<|turn>model\n"])
def test_output_without_channel_markup_is_content(prompt: str) -> None:
    text = "The capital of France is Paris. It has been since 987."
    assert Gemma4ReasoningParser(prompt).split(text) == ReasoningDelta(content=text)
    parser = Gemma4ReasoningParser(prompt)
    assert parser.feed("The capital", finished=False) == ReasoningDelta(content="The capital")  # at once


def test_prompt_left_the_channel_open() -> None:
    # A template (or continue_final_message) that ends the prompt inside the channel: the output is
    # reasoning up to <channel|>, and its "thought" label is still dropped.
    prompt = "<|turn>model\n<|channel>"
    split = Gemma4ReasoningParser(prompt).split("thought\nAdd them.<channel|>4")
    assert (split.reasoning, split.content) == ("Add them.", "4")


def test_thought_label_is_held_until_it_is_known() -> None:
    parser = Gemma4ReasoningParser("")
    assert parser.feed("<|channel>thou", finished=False) == ReasoningDelta()
    assert parser.feed("ght", finished=False) == ReasoningDelta()
    assert parser.feed("\nStep one", finished=False) == ReasoningDelta(reasoning="Step one")
    other = Gemma4ReasoningParser("")
    assert other.feed("<|channel>though", finished=False) == ReasoningDelta()
    assert other.feed("t it over", finished=False) == ReasoningDelta(reasoning="thought it over")


def test_end_of_turn_token_is_dropped_only_at_the_end() -> None:
    parser = Gemma4ReasoningParser(NO_THINK_PROMPT)
    assert parser.feed("Paris.<tu", finished=False) == ReasoningDelta(content="Paris.")
    assert parser.feed("rn|>", finished=True) == ReasoningDelta()
    inside = Gemma4ReasoningParser(NO_THINK_PROMPT).split("Write <turn|> to end a turn.<eos>")
    assert inside.content == "Write <turn|> to end a turn."


def canonical(arguments: object) -> str:
    """JSON text with sorted keys: tells 45 from 45.0 and True from 1, as == on objects does not."""
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def joined_calls(calls: dict[int, dict[str, str]]) -> list[tuple[str, str]]:
    return [(calls[i]["name"], canonical(json.loads(calls[i]["arguments"]))) for i in sorted(calls)]


def expected_calls(case: dict) -> list[tuple[str, str]]:
    return [(call["name"], canonical(call["arguments"])) for call in case["calls"]]


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_tool_fixture_whole(name: str) -> None:
    case = TOOL_CASES[name]
    parsed = Gemma4ToolParser().parse(case["text"])
    assert parsed.content == case["content"]
    assert [(c.name, canonical(json.loads(c.arguments))) for c in parsed.tool_calls] == expected_calls(case)
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_tool_fixture_streamed(name: str) -> None:
    case = TOOL_CASES[name]
    runs = [feed_in_pieces(Gemma4ToolParser(), case["text"], seed) for seed in range(12)]
    runs.append(feed_by_character(Gemma4ToolParser(), case["text"]))
    for _, content, calls in runs:
        assert content == (case["content"] or "")
        assert joined_calls(calls) == expected_calls(case)
        assert all(call["id"].startswith("chatcmpl-tool-") for call in calls.values())


def test_text_streams_at_once_and_a_call_arrives_whole_when_it_closes() -> None:
    parser = Gemma4ToolParser()
    assert parser.feed("Let me check", finished=False).content == "Let me check"
    head = parser.feed(" the weather.\n<|tool_call>call:get_weather{city:" + Q + "Pa", finished=False)
    assert head.content == " the weather." and head.tool_calls == []
    assert parser.feed("ris" + Q + "}<tool_c", finished=False).tool_calls == []
    (call,) = parser.feed("all|>", finished=False).tool_calls
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert call.id is not None
    last = parser.feed("<|tool_response>", finished=True)
    assert last.content is None and last.tool_calls == []


def test_markers_split_across_deltas_as_tokens_would_be() -> None:
    # Token-shaped deltas: each marker one delta, or split in two where a test pushes it.
    pieces = [
        "Sure",
        ".",
        "\n",
        "<|tool",
        "_call>",
        "call",
        ":",
        "add",
        "{",
        "a",
        ":",
        "1",
        ",",
        "b",
        ":",
        Q[:2],
    ]
    pieces += [Q[2:], "x,y", Q, "}", "<tool_call|>", "<|tool_response>"]
    _, content, calls = feed_in_pieces_of(Gemma4ToolParser(), pieces)
    assert content == "Sure."
    assert joined_calls(calls) == [("add", canonical({"a": 1, "b": "x,y"}))]


def test_malformed_call_keeps_the_whitespace_around_it() -> None:
    text = "Checking:\n<|tool_call>call:f{a b}<tool_call|>\ndone"
    assert Gemma4ToolParser().parse(text).content == text


def test_choice_parser_with_both_gemma4_parsers() -> None:
    case = REASONING_CASES["thinking_then_tool_call"]
    text = case["text"]
    parser = ChoiceParser(Gemma4ReasoningParser(case["prompt"]), Gemma4ToolParser())
    message = parser.parse(text)
    assert message.reasoning == case["reasoning"]
    assert message.content is None
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_current_weather", {"location": "London, UK"})
    ]
    assert final_finish_reason("stop", parser.called_tools) == "tool_calls"
    for seed in range(10):
        streamed = ChoiceParser(Gemma4ReasoningParser(case["prompt"]), Gemma4ToolParser())
        reasoning, content, calls = feed_in_pieces(streamed, text, seed)
        assert (reasoning, content) == (case["reasoning"], "")
        assert joined_calls(calls) == [("get_current_weather", canonical({"location": "London, UK"}))]
        assert streamed.called_tools


def test_choice_parser_answer_without_tools() -> None:
    parser = ChoiceParser(Gemma4ReasoningParser(NO_THINK_PROMPT), Gemma4ToolParser())
    message = parser.parse("It is sunny in Paris today.<turn|>")
    assert (message.reasoning, message.content, message.tool_calls) == (
        None,
        "It is sunny in Paris today.",
        [],
    )
    assert final_finish_reason("stop", parser.called_tools) == "stop"
