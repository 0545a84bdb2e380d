"""The gemma4 parsers through the chat route: a Gemma-4-shaped template, recorded Gemma-4 outputs replayed
token by token, whole and streamed answers, and special tokens kept in the text while they parse."""

from __future__ import annotations

import json

import pytest

from tests.unit.server_helpers import ReplayEngine, build_test_client, sse_payloads

Q = '<|"|>'
# A small template in Gemma-4's turn format (written for this test): the system turn carries <|think|>
# when thinking is on; with thinking off the model's turn starts with an empty, closed thought channel.
TEMPLATE = (
    "{{ bos_token }}{% if enable_thinking or tools %}<|turn>system\n"
    "{% if enable_thinking %}<|think|>{% endif %}"
    "{% for t in tools or [] %}<|tool>declaration:{{ t.function.name }}{}<tool|>{% endfor %}"
    "<turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n"
    "{% if not enable_thinking %}<|channel>thought\n<channel|>{% endif %}{% endif %}"
)
THOUGHT = "The user wants the weather in Oslo, so I call get_weather."
THINKING_TOOL_OUTPUT = (
    f"<|channel>thought\n{THOUGHT}<channel|><|tool_call>call:get_weather{{city:{Q}Oslo{Q},days:2}}"
    "<tool_call|><|tool_response>"
)
PLAIN_ANSWER = "Oslo is the capital of Norway.<turn|>"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


class RecordingEngine(ReplayEngine):
    """Keeps each request's SamplingParams, to see what the chat route asked the engine for."""

    def __init__(self) -> None:
        super().__init__(
            lambda prompt, index: THINKING_TOOL_OUTPUT if "<|think|>" in prompt else PLAIN_ANSWER
        )
        self.params_seen: list = []

    def add_request(self, request_id, prompt, prompt_token_ids, params) -> None:
        self.params_seen.append(params)
        super().add_request(request_id, prompt, prompt_token_ids, params)


def serve(**settings):
    engine = RecordingEngine()
    test_client, _ = build_test_client(lambda p, i: "", engine=engine, chat_template=TEMPLATE, **settings)
    return test_client, engine


def chat(thinking: bool, **extra: object) -> dict:
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], **extra}
    return {**body, "chat_template_kwargs": {"enable_thinking": thinking}}


def message_and_deltas(test_client, body: dict) -> tuple[dict, list[dict]]:
    whole = test_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    events = sse_payloads(test_client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[-2]["choices"][0]["finish_reason"] == whole["finish_reason"]
    return whole, [e["choices"][0]["delta"] for e in events[:-1]]


@pytest.fixture(scope="module")
def gemma4_server():
    test_client, engine = serve(
        reasoning_parser="gemma4", enable_auto_tool_choice=True, tool_call_parser="gemma4"
    )
    with test_client:
        yield test_client, engine


def test_thinking_and_a_tool_call(gemma4_server) -> None:
    test_client, engine = gemma4_server
    whole, deltas = message_and_deltas(test_client, chat(True, tools=[WEATHER_TOOL]))
    assert whole["finish_reason"] == "tool_calls"
    message = whole["message"]
    assert message["reasoning_content"] == THOUGHT and message.get("content") is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("content") or "" for d in deltas) == ""
    (streamed,) = [c for d in deltas for c in d.get("tool_calls") or []]  # one fragment: the whole call
    assert streamed["id"].startswith("chatcmpl-tool-") and streamed["type"] == "function"
    assert streamed["function"] == {"name": "get_weather", "arguments": call["function"]["arguments"]}
    assert [p.skip_special_tokens for p in engine.params_seen[-2:]] == [False, False]


def test_thinking_off_answer_is_content(gemma4_server) -> None:
    test_client, engine = gemma4_server
    whole, deltas = message_and_deltas(test_client, chat(False))
    assert whole["message"] == {"role": "assistant", "content": "Oslo is the capital of Norway."}
    assert whole["finish_reason"] == "stop"
    assert "".join(d.get("content") or "" for d in deltas) == "Oslo is the capital of Norway."
    assert not any(d.get("reasoning_content") for d in deltas)
    assert engine.params_seen[-1].skip_special_tokens is False  # the reasoning parser needs them always


def test_tool_parser_alone_keeps_special_tokens_only_for_requests_it_parses() -> None:
    test_client, engine = serve(enable_auto_tool_choice=True, tool_call_parser="gemma4")
    with test_client:
        for body in (chat(False), chat(False, tools=[WEATHER_TOOL], tool_choice="none")):
            assert test_client.post("/v1/chat/completions", json=body).status_code == 200
        assert [p.skip_special_tokens for p in engine.params_seen] == [True, True]
        answer = test_client.post("/v1/chat/completions", json=chat(True, tools=[WEATHER_TOOL])).json()
        assert engine.params_seen[-1].skip_special_tokens is False
        # Without the reasoning parser the thought stays in the content; the call is still parsed.
        assert answer["choices"][0]["message"]["content"] == f"<|channel>thought\n{THOUGHT}<channel|>"
        assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_template_shipped_as_chat_template_jinja_is_the_default(tmp_path) -> None:
    # Gemma-4 tokenizers ship their template as chat_template.jinja beside tokenizer_config.json.
    from transformers import AutoTokenizer

    from fitserve.server.chat import ChatRenderer
    from fitserve.server.protocol import ChatMessage
    from tests.unit.server_helpers import TOKENIZER_PATH

    tokenizer_dir = tmp_path / "gemma4-like"
    AutoTokenizer.from_pretrained(TOKENIZER_PATH).save_pretrained(tokenizer_dir)
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (tokenizer_dir / "chat_template.jinja").write_text(TEMPLATE)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tokenizer_dir), chat_template=None)
    prompt = renderer.render([ChatMessage(role="user", content="Hi")])
    assert prompt.endswith("<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
