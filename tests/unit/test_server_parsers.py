"""Reasoning and tool-call parsers: whole outputs, and the same outputs fed in random pieces."""

from __future__ import annotations

import json
import random

import pytest

from fitserve.server.choice_parsing import ChoiceParser, final_finish_reason
from fitserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ReasoningDelta
from fitserve.server.parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from fitserve.server.parsers.hermes import HermesToolParser
from fitserve.server.parsers.qwen3 import Qwen3ReasoningParser
from fitserve.server.parsers.text_scan import partial_tag_suffix_len


def feed_in_pieces(parser, text: str, seed: int) -> tuple[str, str, dict[int, dict[str, str]]]:
    """Feeds `text` in random pieces of 1-6 characters; returns (reasoning, content, tool calls)."""
    rng = random.Random(seed)
    reasoning, content, calls = "", "", {}
    position = 0
    while position < len(text):
        end = min(len(text), position + rng.randint(1, 6))
        delta = parser.feed(text[position:end], end == len(text))
        position = end
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        for call in getattr(delta, "tool_calls", []):
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.name or ""
            entry["arguments"] += call.arguments or ""
    return reasoning, content, calls


def test_partial_tag_suffix() -> None:
    assert partial_tag_suffix_len("abc</thi", "</think>") == 5
    assert partial_tag_suffix_len("abc<", "<tool_call>") == 1
    assert partial_tag_suffix_len("abc", "<tool_call>") == 0
    assert partial_tag_suffix_len("</think>", "</think>") == 0  # a whole tag is not a partial one


# The parsers of <think>...</think> (gemma4's tags are others: test_server_parsers_gemma4.py).
THINK_TAG_PARSERS = sorted(name for name, cls in REASONING_PARSERS.items() if cls.start_tag == "<think>")
# A DeepSeek-R1 distill's rendered prompt: the template opens <think> for the model.
R1_PROMPT = "<｜User｜>2+2?<｜Assistant｜><think>\n"
# Qwen3 with enable_thinking=False: the template closes an empty block for the model.
QWEN3_NO_THINK_PROMPT = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# A model that does not reason (Qwen2.5-Instruct, SmolLM2): no tag in the prompt.
PLAIN_PROMPT = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("prompt", "text", "reasoning", "content"),
    [
        ("", "<think>\nTwo plus two.\n</think>\n\nIt is 4.", "Two plus two.", "It is 4."),
        (R1_PROMPT, "Two plus two.\n</think>\n\nIt is 4.", "Two plus two.", "It is 4."),
        ("", "Two plus two.\n</think>\n\nIt is 4.", "Two plus two.", "It is 4."),  # closed, never opened
        (R1_PROMPT, "Still thinking about", "Still thinking about", None),  # cut off while reasoning
        (PLAIN_PROMPT, "It is 4.", None, "It is 4."),  # no markup anywhere: a plain answer
        ("", "say <think> literally", None, "say <think> literally"),  # a tag mid-text opens nothing
        ("", "<think>a</think>", "a", None),
        (PLAIN_PROMPT, "<think>a</think>b", "a", "b"),
    ],
)
def test_deepseek_r1_split(prompt: str, text: str, reasoning: str | None, content: str | None) -> None:
    split = DeepSeekR1ReasoningParser(prompt).split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(
    ("prompt", "text", "reasoning", "content"),
    [
        ("", "<think>\nHmm.\n</think>\n\nYes.", "Hmm.", "Yes."),
        ("", "No tags here.", None, "No tags here."),  # thinking off: everything is content
        ("<|im_start|>assistant\n<think>\n", "Hmm.\n</think>\n\nYes.", "Hmm.", "Yes."),  # prompt opened it
        ("<think>\n\n</think>\n\n", "Plain answer.", None, "Plain answer."),  # prompt closed an empty block
        (QWEN3_NO_THINK_PROMPT, "It is 4.", None, "It is 4."),
        ("<|im_start|>assistant\n<think>\n", "Cut off while", "Cut off while", None),
        (PLAIN_PROMPT, "<think>a</think>b", "a", "b"),
        (PLAIN_PROMPT, "a</think>b", None, "a</think>b"),  # qwen3 needs an opened block
    ],
)
def test_qwen3_split(prompt: str, text: str, reasoning: str | None, content: str | None) -> None:
    split = Qwen3ReasoningParser(prompt).split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", [PLAIN_PROMPT, R1_PROMPT, QWEN3_NO_THINK_PROMPT])
@pytest.mark.parametrize(
    "text",
    [
        "<think>\nLet me see: 2+2.\n</think>\n\nThe answer is 4.",
        "I reason </thin here </think> answer with </think> inside",
        "<thinking is not the tag",
        "   <think>spaces first</think>   then content  ",
        "  A plain answer with no tags, long enough to span many deltas.  ",
        "a</think>b",
    ],
)
def test_reasoning_streaming_matches_whole(name: str, prompt: str, text: str) -> None:
    whole = REASONING_PARSERS[name](prompt).split(text)
    for seed in range(20):
        reasoning, content, _ = feed_in_pieces(REASONING_PARSERS[name](prompt), text, seed)
        assert (reasoning or None, content or None) == (whole.reasoning, whole.content), seed


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", ["", PLAIN_PROMPT, QWEN3_NO_THINK_PROMPT])
def test_output_without_markup_is_content(name: str, prompt: str) -> None:
    text = "\nThe capital of France is Paris. It has been since 987."
    whole = REASONING_PARSERS[name](prompt).split(text)
    assert (whole.reasoning, whole.content) == (None, text.lstrip())
    for seed in range(5):
        reasoning, content, _ = feed_in_pieces(REASONING_PARSERS[name](prompt), text, seed)
        assert (reasoning, content) == ("", text.lstrip()), seed


@pytest.mark.parametrize("name", THINK_TAG_PARSERS)
def test_prompt_opened_think_makes_untagged_output_reasoning(name: str) -> None:
    # R1's template ends the prompt inside <think>; max_tokens cut the output before </think>.
    text = "Okay, the user asks for 2+2. I add"
    whole = REASONING_PARSERS[name](R1_PROMPT).split(text)
    assert (whole.reasoning, whole.content) == (text, None)
    parser = REASONING_PARSERS[name](R1_PROMPT)
    assert parser.feed("Okay, the user", finished=False).reasoning == "Okay, the user"  # streamed at once


def test_deepseek_r1_holds_untagged_text_until_end_tag_or_end() -> None:
    # No tag opened yet: the text is reasoning if "</think>" comes, content if not. Until then, nothing.
    answer = DeepSeekR1ReasoningParser(PLAIN_PROMPT)
    assert answer.feed("The capital", finished=False) == ReasoningDelta()
    assert answer.feed(" is Paris.</thi", finished=False) == ReasoningDelta()
    last = answer.feed("s is it", finished=True)
    assert last == ReasoningDelta(content="The capital is Paris.</this is it")
    closed = DeepSeekR1ReasoningParser(PLAIN_PROMPT)
    assert closed.feed("I add.</thi", finished=False) == ReasoningDelta()
    assert closed.feed("nk>4", finished=False) == ReasoningDelta(reasoning="I add.", content="4")
    assert closed.feed(" exactly", finished=True) == ReasoningDelta(content=" exactly")


def test_qwen3_streams_untagged_output_as_content_at_once() -> None:
    parser = Qwen3ReasoningParser(QWEN3_NO_THINK_PROMPT)
    assert parser.feed("It is", finished=False) == ReasoningDelta(content="It is")
    assert parser.feed(" 4.", finished=True) == ReasoningDelta(content=" 4.")


def test_reasoning_stream_holds_back_a_partial_end_tag() -> None:
    parser = DeepSeekR1ReasoningParser(R1_PROMPT)
    first = parser.feed("Thinking</thi", finished=False)
    assert first.reasoning == "Thinking" and first.content is None
    second = parser.feed("nk>Done", finished=False)
    assert second.reasoning is None and second.content == "Done"


WEATHER_OUTPUT = (
    "Let me check the weather.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": {"temp": "C"}}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>'
)


def test_hermes_parses_calls_and_content() -> None:
    parsed = HermesToolParser().parse(WEATHER_OUTPUT)
    assert parsed.content == "Let me check the weather."
    assert [call.name for call in parsed.tool_calls] == ["get_weather", "get_weather"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Paris", "units": {"temp": "C"}}
    assert json.loads(parsed.tool_calls[1].arguments) == {"city": "Rome"}
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


@pytest.mark.parametrize("seed", range(30))
def test_hermes_streaming_matches_whole(seed: int) -> None:
    whole = HermesToolParser().parse(WEATHER_OUTPUT)
    _, content, calls = feed_in_pieces(HermesToolParser(), WEATHER_OUTPUT, seed)
    assert content == whole.content
    assert [calls[i]["name"] for i in sorted(calls)] == [c.name for c in whole.tool_calls]
    for i, call in enumerate(whole.tool_calls):
        assert json.loads(calls[i]["arguments"]) == json.loads(call.arguments)
        assert calls[i]["id"].startswith("chatcmpl-tool-")


def test_hermes_streams_arguments_before_the_block_closes() -> None:
    parser = HermesToolParser()
    head = parser.feed('<tool_call>{"name": "f", "arguments": {"q": "long', finished=False)
    assert [(c.name, c.arguments) for c in head.tool_calls] == [("f", ""), (None, '{"q": "long')]
    tail = parser.feed(' text"}}</tool_call>', finished=True)
    assert [c.arguments for c in tail.tool_calls] == [' text"}']


def test_hermes_invalid_block_is_content() -> None:
    parsed = HermesToolParser().parse("Sure <tool_call>not json</tool_call>")
    assert parsed.tool_calls == []
    assert parsed.content == "Sure<tool_call>not json</tool_call>"


def test_hermes_unclosed_block_at_the_end_still_counts() -> None:
    parsed = HermesToolParser().parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"a": 1})]
    assert parsed.content is None


def test_hermes_holds_back_a_partial_open_tag() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hi <tool", finished=False).content == "Hi"
    assert parser.feed("box> there", finished=True).content == " <toolbox> there"


def test_choice_parser_reasoning_then_tools() -> None:
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "w", "arguments": {}}</tool_call>'
    parser = ChoiceParser(DeepSeekR1ReasoningParser(""), TOOL_CALL_PARSERS["hermes"]())
    message = parser.parse(text)
    assert message.reasoning == "I need the weather."
    assert message.content is None
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("w", "{}")]
    assert final_finish_reason("stop", parser.called_tools) == "tool_calls"
    assert final_finish_reason("length", parser.called_tools) == "length"
    streamed = ChoiceParser(DeepSeekR1ReasoningParser(""), TOOL_CALL_PARSERS["hermes"]())
    reasoning, content, calls = feed_in_pieces(streamed, text, seed=3)
    assert (reasoning, content, calls[0]["name"], calls[0]["arguments"]) == (
        "I need the weather.",
        "",
        "w",
        "{}",
    )
