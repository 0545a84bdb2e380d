"""`--reasoning-parser qwen3 --tool-call-parser qwen3_coder` with Qwen3.5/3.6's chat format: a conversation
with tool calls rendered by the template and the model's side of it parsed back, whole and streamed, and the
two parsers through the chat route (a replayed model behind the real server).

The template here is written for these tests in the format of Qwen3.5/3.6's (the system turn lists the
tools; an assistant turn after the last user message carries `<think>...</think>`; calls are
`<tool_call><function=...><parameter=...>` with values printed as Jinja prints them, objects and lists as
JSON; the generation prompt opens `<think>` for the model, or closes an empty one with thinking off). When
the shared models folder holds Qwen3.6-27B's own template (chat_template.jinja, or tokenizer_config.json's
chat_template), the round trip runs on it too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitserve.server.chat import ChatRenderer
from fitserve.server.choice_parsing import ChoiceParser
from fitserve.server.parsers.qwen3 import Qwen3ReasoningParser
from fitserve.server.parsers.qwen3_coder import Qwen3CoderToolParser
from fitserve.server.protocol import ChatCompletionToolParam, ChatMessage
from tests.paths import MODELS_DIR
from tests.unit.server_helpers import (
    ReplayEngine,
    build_test_client,
    replay_config,
    smollm2_tokenizer,
    sse_payloads,
)
from tests.unit.test_server_parsers_qwen3_coder import RUN_TOOL, WEATHER_TOOL

TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function reply with:\\n<tool_call>\\n<function=NAME>\\n"
    "<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- set content = m.content or '' %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '').strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}{%- set call = tc.function if tc.function is defined else tc %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- elif content | trim %}{{- '\\n\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}"
    "{%- for name, value in call.arguments | items %}{{- '<parameter=' + name + '>\\n' }}"
    "{%- if value is mapping or (value is sequence and value is not string) %}{{- value | tojson }}"
    "{%- else %}{{- value | string }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
QWEN36_DIR = MODELS_DIR / "qwen3.6-27b"


def shipped_template(model_dir: Path) -> str | None:
    """The chat template a model folder ships, if any."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


TEMPLATES = [pytest.param(TEMPLATE, id="qwen36-format")]
TEMPLATES.append(
    pytest.param(
        shipped_template(QWEN36_DIR),
        id="qwen3.6-27b-shipped",
        marks=pytest.mark.skipif(
            shipped_template(QWEN36_DIR) is None, reason=f"no chat template in {QWEN36_DIR}"
        ),
    )
)
TOOLS = [WEATHER_TOOL, RUN_TOOL]
CODE = 'import sys\n\nprint("a </parameter> b", {"k": 1})\n'
CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    (
        "run",
        {
            "code": CODE,
            "count": 2,
            "ratio": 0.75,
            "verbose": True,
            "options": {"depth": [1, 2], "name": "x"},
            "tags": ["a b", "c"],
            "note": None,
        },
    ),
]
REASONING = "The user wants the weather, then a script run."


def render(template: str, messages: list[dict], **kwargs) -> str:
    renderer = ChatRenderer(smollm2_tokenizer(), template)
    tools = [ChatCompletionToolParam(**tool) for tool in TOOLS]
    return renderer.render([ChatMessage(**m) for m in messages], tools=tools, **kwargs)


def assistant_turn(content: str | None) -> dict:
    calls = [
        {"id": f"call_{i}", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(CALLS)
    ]
    return {"role": "assistant", "content": content, "reasoning_content": REASONING, "tool_calls": calls}


def model_side(template: str, content: str | None, **kwargs) -> tuple[str, str]:
    """(the prompt the model saw, what it wrote): the conversation rendered up to the generation prompt,
    and the rest of the assistant turn as the template renders it."""
    user = [{"role": "user", "content": "Weather in Paris? Then run my script."}]
    prompt = render(template, user, **kwargs)
    full = render(template, [*user, assistant_turn(content)], add_generation_prompt=False, **kwargs)
    assert full.startswith(prompt), "the template renders a past turn unlike the generation prompt"
    return prompt, full[len(prompt) : full.index("<|im_end|>", len(prompt))]


def parse_streamed(parser: ChoiceParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, i == len(pieces) - 1)
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for fragment in delta.tool_calls:
            entry = calls.setdefault(fragment.index, ["", ""])
            entry[0] += fragment.name or ""
            entry[1] += fragment.arguments or ""
    return reasoning, content, [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("content", ["I will check the weather first.", None])
def test_rendered_calls_parse_back(template: str, content: str | None) -> None:
    prompt, output = model_side(template, content)
    assert prompt.endswith("<think>\n") and "<think>" not in output  # the template opened the block
    parsers = (Qwen3ReasoningParser(prompt), Qwen3CoderToolParser(TOOLS))
    message = ChoiceParser(*parsers).parse(output)
    assert message.reasoning == REASONING
    assert message.content == content
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == CALLS
    expected = (REASONING, content or "", CALLS)
    assert (
        parse_streamed(ChoiceParser(Qwen3ReasoningParser(prompt), Qwen3CoderToolParser(TOOLS)), list(output))
        == expected
    )
    for cut in range(len(output) + 1):
        pieces = [output[:cut], output[cut:]]
        streamed = parse_streamed(
            ChoiceParser(Qwen3ReasoningParser(prompt), Qwen3CoderToolParser(TOOLS)), pieces
        )
        assert streamed == expected, cut


@pytest.mark.parametrize("template", TEMPLATES)
def test_thinking_off_prompt_closes_the_block(template: str) -> None:
    prompt = render(template, [{"role": "user", "content": "Hi"}], template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<think>\n\n</think>\n\n")
    output = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    )
    message = ChoiceParser(Qwen3ReasoningParser(prompt), Qwen3CoderToolParser(TOOLS)).parse(output)
    assert (message.reasoning, message.content) == (None, None)
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    plain = ChoiceParser(Qwen3ReasoningParser(prompt), Qwen3CoderToolParser(TOOLS)).parse("Hello!")
    assert (plain.reasoning, plain.content, plain.tool_calls) == (None, "Hello!", [])


@pytest.mark.parametrize("template", TEMPLATES)
def test_second_turn_after_a_tool_response(template: str) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        assistant_turn(None),
        {"role": "tool", "tool_call_id": "call_0", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    prompt = render(template, history)
    assert prompt.endswith("<think>\n") and prompt.count("<think>") == 2  # the past turn's block is closed
    output = "The tool says sunny.\n</think>\n\nIt is sunny in Paris."
    message = ChoiceParser(Qwen3ReasoningParser(prompt), Qwen3CoderToolParser(TOOLS)).parse(output)
    assert (message.reasoning, message.content, message.tool_calls) == (
        "The tool says sunny.",
        "It is sunny in Paris.",
        [],
    )


MODEL_CALL_OUTPUT = (
    "The user wants the weather in Paris.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
MODEL_ANSWER = "The tool says sunny.\n</think>\n\nIt is sunny in Paris."


@pytest.fixture(scope="module")
def qwen36_server():
    def script(prompt: str, index: int) -> str:
        return MODEL_ANSWER if "<tool_response>" in prompt else MODEL_CALL_OUTPUT

    engine = ReplayEngine(script, config=replay_config(max_model_len=4096))
    test_client, _ = build_test_client(
        script,
        engine=engine,
        chat_template=TEMPLATE,
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="qwen3_coder",
    )
    with test_client:
        yield test_client


def chat_body(**extra: object) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL], **extra}


def test_chat_route_whole_and_streamed(qwen36_server) -> None:
    whole = qwen36_server.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert message["reasoning_content"] == "The user wants the weather in Paris."
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}

    events = sse_payloads(qwen36_server.post("/v1/chat/completions", json=chat_body(stream=True)).text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    fragments = [c for d in deltas for c in d.get("tool_calls") or []]
    assert len(fragments) > 2  # name first, then the arguments in pieces
    assert fragments[0]["function"]["name"] == "get_weather" and fragments[0]["type"] == "function"
    assert all(
        f["index"] == 0 and f.get("id") is None and not f["function"].get("name") for f in fragments[1:]
    )
    arguments = "".join(f["function"].get("arguments") or "" for f in fragments)
    assert arguments == call["function"]["arguments"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("<" in (d.get("content") or "") for d in deltas)


def test_chat_route_tool_round_trip_and_tool_choice_none(qwen36_server) -> None:
    first = qwen36_server.post("/v1/chat/completions", json=chat_body()).json()["choices"][0]["message"]
    (call,) = first["tool_calls"]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": first["content"], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'},
    ]
    second = qwen36_server.post("/v1/chat/completions", json=chat_body(messages=history)).json()["choices"][0]
    assert second["finish_reason"] == "stop"
    assert second["message"]["content"] == "It is sunny in Paris."
    assert second["message"]["reasoning_content"] == "The tool says sunny."
    untouched = qwen36_server.post("/v1/chat/completions", json=chat_body(tool_choice="none")).json()
    choice = untouched["choices"][0]
    assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
    assert choice["message"]["content"].startswith("Let me check.\n\n<tool_call>\n<function=get_weather>")
