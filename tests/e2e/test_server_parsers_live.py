"""Reasoning and tool-call parsing with the live model. The model's output cannot be dictated, so the
requests lead it with few-shot histories (and per-request chat templates) into writing `</think>` and
`<tool_call>` blocks under greedy decoding; the split is then checked against the raw text the same
prompt produces on /v1/completions."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import LiveServer

pytestmark = pytest.mark.e2e

# Opens <think> in every assistant turn; the few-shot answers close it.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}<think>\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
THINK_HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "I add two and two.\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "I add three and three.\n</think>\n\n6"},
    {"role": "user", "content": "5+5?"},
]

# Renders tools, assistant tool calls as Hermes blocks and tool results, like Qwen2.5's template.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou can call: {% for t in tools %}{{ t.function.name }}{% endfor %}. "
    'Call it as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def weather_call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=120)


def raw_text(
    server: LiveServer, messages: list[dict], template: str, max_tokens: int, **extra: object
) -> str:
    """What the model writes for the chat prompt, unparsed (the same greedy request on /v1/completions)."""
    tokens = post(server, "/tokenize", {"messages": messages, "chat_template": template, **extra}).json()[
        "tokens"
    ]
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    return post(server, "/v1/completions", body).json()["choices"][0]["text"]


def streamed_chunks(live_server: LiveServer, body: dict) -> list[dict]:
    """The chunks of the same chat request, streamed."""
    events = httpx.post(
        live_server.url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers=live_server.headers,
        timeout=120,
    ).text.splitlines()
    return [json.loads(e[6:]) for e in events if e.startswith("data: {")]


def streamed_deltas(live_server: LiveServer, body: dict) -> list[dict]:
    """The message deltas of the same chat request, streamed."""
    return [chunk["choices"][0]["delta"] for chunk in streamed_chunks(live_server, body)]


def test_reasoning_split(live_server: LiveServer) -> None:
    body = {"messages": THINK_HISTORY, "chat_template": THINK_TEMPLATE, "max_tokens": 24, "temperature": 0}
    message = post(live_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    raw = raw_text(live_server, THINK_HISTORY, THINK_TEMPLATE, 24)
    assert "</think>" in raw, raw
    reasoning, _, content = raw.partition("</think>")
    assert message["reasoning_content"] == reasoning.strip()
    assert message["content"] == content.strip()
    assert message["reasoning_content"] and message["content"]

    deltas = streamed_deltas(live_server, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_plain_chat_is_untouched_by_the_reasoning_parser(live_server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
    message = post(live_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]

    deltas = streamed_deltas(live_server, body)
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == message["content"]


def test_tool_call_round_trip(live_server: LiveServer) -> None:
    # Few-shot: two earlier turns answered with a call lead the model to answer the third with one.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [weather_call("call_1", "Paris")]},
        {"role": "user", "content": "Weather in Berlin?"},
        {"role": "assistant", "content": None, "tool_calls": [weather_call("call_2", "Berlin")]},
        {"role": "user", "content": "Weather in Rome?"},
    ]
    request = {
        "messages": history,
        "tools": [WEATHER_TOOL],
        "chat_template": TOOL_TEMPLATE,
        "max_tokens": 40,
        "temperature": 0,
    }
    choice = post(live_server, "/v1/chat/completions", request).json()["choices"][0]
    raw = raw_text(live_server, history, TOOL_TEMPLATE, 40, tools=[WEATHER_TOOL])
    assert "<tool_call>" in raw, raw
    block = raw.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    expected = json.loads(block)
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == expected["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == expected["arguments"]

    chunks = streamed_chunks(live_server, request)
    fragments = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(f["function"].get("name", "") for f in fragments) == "get_weather"
    assert json.loads("".join(f["function"].get("arguments", "") for f in fragments)) == expected["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    answer_history = history + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18C and sunny"},
    ]
    prompt = post(
        live_server,
        "/tokenize",
        {"messages": answer_history, "tools": [WEATHER_TOOL], "chat_template": TOOL_TEMPLATE},
    ).json()
    detokenized = post(live_server, "/detokenize", {"tokens": prompt["tokens"]}).json()["prompt"]
    assert f'"arguments": {json.dumps(expected["arguments"])}' in detokenized
    assert "<tool_response>\n18C and sunny\n</tool_response>" in detokenized
    answer = post(live_server, "/v1/chat/completions", {**request, "messages": answer_history}).json()[
        "choices"
    ][0]
    assert answer["finish_reason"] in ("stop", "length", "tool_calls")
    assert answer["message"]["content"] or answer["message"].get("tool_calls")
