"""Chat and completions end to end through the serving layer, with recorded model outputs replayed
token by token: response shapes, streams, n, stop, logprobs, reasoning and tool-call parsing."""

from __future__ import annotations

import json

import pytest

from tests.unit.server_helpers import build_test_client, smollm2_tokenizer, sse_payloads

ANSWER = "The capital of France is Paris."
REASONING_OUTPUT = "Paris is in France, so the capital is Paris.\n</think>\n\nThe capital is Paris."
TOOL_OUTPUT = (
    'I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chat(messages_text: str = "Capital of France?", **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": messages_text}], **extra}


@pytest.fixture(scope="module")
def client():
    test_client, _ = build_test_client(
        lambda prompt, index: ANSWER if index == 0 else f"Choice {index}: {ANSWER}"
    )
    with test_client:
        yield test_client


def test_chat_response_shape_and_usage(client) -> None:
    body = client.post("/v1/chat/completions", json=chat()).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "replay-model"
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "message": {"role": "assistant", "content": ANSWER},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }
    prompt_tokens = client.post("/tokenize", json={"messages": chat()["messages"]}).json()["count"]
    completion_tokens = len(smollm2_tokenizer().encode(ANSWER))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def test_max_tokens_and_max_completion_tokens_cut_with_length(client) -> None:
    first_three = smollm2_tokenizer().decode(smollm2_tokenizer().encode(ANSWER)[:3])
    for field in ("max_tokens", "max_completion_tokens"):
        choice = client.post("/v1/chat/completions", json=chat(**{field: 3})).json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (first_three, "length")


def test_stop_string_cuts_the_text(client) -> None:
    choice = client.post("/v1/chat/completions", json=chat(stop=[" Paris"])).json()["choices"][0]
    assert choice["message"]["content"] == "The capital of France is"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", " Paris")


def test_n_returns_each_choice(client) -> None:
    body = client.post("/v1/chat/completions", json=chat(n=2)).json()
    assert [c["message"]["content"] for c in body["choices"]] == [ANSWER, f"Choice 1: {ANSWER}"]
    assert [c["index"] for c in body["choices"]] == [0, 1]


def test_chat_stream_chunks(client) -> None:
    response = client.post(
        "/v1/chat/completions", json=chat(stream=True, n=2, stream_options={"include_usage": True})
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    texts = {0: "", 1: ""}
    reasons = {}
    for c in chunks[2:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {0: ANSWER, 1: f"Choice 1: {ANSWER}"}
    assert reasons == {0: "stop", 1: "stop"}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(
        smollm2_tokenizer().encode(ANSWER)
    ) + len(smollm2_tokenizer().encode(f"Choice 1: {ANSWER}"))


def test_chat_logprobs(client) -> None:
    choice = client.post(
        "/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2, max_tokens=2)
    ).json()["choices"][0]
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode(ANSWER)[:2]
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [tokenizer.decode([i]) for i in ids]
    assert all(entry["logprob"] == pytest.approx(-0.6931, abs=1e-3) for entry in content)
    first = content[0]
    assert first["bytes"] == list(first["token"].encode())
    assert [t["token"] for t in first["top_logprobs"]] == [
        tokenizer.decode([ids[0]]),
        tokenizer.decode([ids[0] + 1]),
    ]


def test_completion_shapes_prompts_and_logprobs(client) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": [[19556, 905], [19556]], "n": 2, "max_tokens": 2, "logprobs": 1}
    ).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    tokenizer = smollm2_tokenizer()
    two = tokenizer.decode(tokenizer.encode(ANSWER)[:2])
    assert [c["text"] for c in body["choices"]][::2] == [two, two]
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in tokenizer.encode(ANSWER)[:2]]
    assert logprobs["text_offset"] == [0, len(logprobs["tokens"][0])]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["completion_tokens"] == 8


def test_completion_echo_and_stream(client) -> None:
    echoed = client.post("/v1/completions", json={"prompt": "Hi there", "echo": True, "max_tokens": 3}).json()
    tokenizer = smollm2_tokenizer()
    assert echoed["choices"][0]["text"] == "Hi there" + tokenizer.decode(tokenizer.encode(ANSWER)[:3])
    response = client.post("/v1/completions", json={"prompt": ["A", "B"], "stream": True, "max_tokens": 4})
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: tokenizer.decode(tokenizer.encode(ANSWER)[:4])} | {
        1: tokenizer.decode(tokenizer.encode(ANSWER)[:4])
    }


# Of these 9 tokens, the 1st, 4th, 5th and 7th end inside a UTF-8 character and add no text yet.
PARTIAL_UTF8_ANSWER = "日本語です"


@pytest.fixture(scope="module")
def partial_utf8_client():
    test_client, _ = build_test_client(lambda prompt, index: PARTIAL_UTF8_ANSWER, step_delay_s=0.03)
    with test_client:
        yield test_client


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_that_add_no_text_are_streamed_as_empty_chunks(partial_utf8_client, route: str) -> None:
    """As in vLLM, every step's tokens make a chunk: a client sees the first token when it is made."""
    body = {"prompt": "Say it", "max_tokens": 20} if route == "/v1/completions" else chat("Say it")
    events = sse_payloads(partial_utf8_client.post(route, json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]"
    if route == "/v1/completions":
        texts = [event["choices"][0]["text"] for event in events[:-1]]
    else:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        texts = [event["choices"][0]["delta"].get("content", "") for event in events[1:-1]]
    assert "".join(texts) == PARTIAL_UTF8_ANSWER
    # the silent tokens' chunks, before the last one (one step each: the replay's steps are 30 ms apart)
    assert "" in texts[:-1]
    assert 6 <= len(texts) <= 9


# ---- reasoning and tool calls, through the serving layer ------------------------------------------------


@pytest.fixture(scope="module")
def reasoning_client():
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    test_client, _ = build_test_client(
        lambda prompt, index: REASONING_OUTPUT,
        step_delay_s=0.01,
        chat_template=template,
        reasoning_parser="deepseek_r1",
    )
    with test_client:
        yield test_client


def test_reasoning_split_whole_and_streamed(reasoning_client) -> None:
    message = reasoning_client.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "The capital is Paris.",
        "reasoning_content": "Paris is in France, so the capital is Paris.",
    }
    events = sse_payloads(reasoning_client.post("/v1/chat/completions", json=chat(stream=True)).text)
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events[:-1])
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    first_content = next(i for i, e in enumerate(events[1:-1]) if e["choices"][0]["delta"].get("content"))
    last_reasoning = max(
        i for i, e in enumerate(events[1:-1]) if e["choices"][0]["delta"].get("reasoning_content")
    )
    assert last_reasoning < first_content


def message_and_stream(test_client, body: dict) -> tuple[dict, list[dict]]:
    """The non-streamed message for `body`, and the deltas of the same request streamed."""
    message = test_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    events = sse_payloads(test_client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    return message, [e["choices"][0]["delta"] for e in events[:-1]]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_prompt_opened_think_cut_by_max_tokens_is_reasoning(reasoning_client) -> None:
    # The template ends the prompt with <think> (as DeepSeek-R1 distills' does); no </think> comes.
    message, deltas = message_and_stream(reasoning_client, chat(max_tokens=5))
    assert message["reasoning_content"] and "Paris is in" in message["reasoning_content"]
    assert message["content"] is None
    assert joined(deltas, "reasoning_content") == message["reasoning_content"]
    assert joined(deltas, "content") == ""


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_output_without_think_tags_is_content(parser: str) -> None:
    # SmolLM2's own template opens no <think>: a model that does not reason, served with a reasoning
    # parser. Its plain answers are content; an answer with a whole <think> block is still split.
    test_client, _ = build_test_client(
        lambda prompt, index: "<think>a</think>b" if "Think first" in prompt else ANSWER,
        reasoning_parser=parser,
    )
    with test_client:
        message, deltas = message_and_stream(test_client, chat())
        assert message == {"role": "assistant", "content": ANSWER}
        assert joined(deltas, "content") == ANSWER
        assert not any("reasoning_content" in d for d in deltas)
        message, deltas = message_and_stream(test_client, chat("Think first: 2+2?"))
        assert message == {"role": "assistant", "content": "b", "reasoning_content": "a"}
        assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == ("a", "b")


@pytest.fixture(scope="module")
def tool_client():
    test_client, engine = build_test_client(
        lambda prompt, index: (
            "It is 18C and sunny in Paris." if "<|im_start|>tool" in prompt else TOOL_OUTPUT
        ),
        step_delay_s=0.01,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with test_client:
        yield test_client


def test_tool_call_round_trip(tool_client) -> None:
    first = tool_client.post(
        "/v1/chat/completions", json=chat("Weather in Paris?", tools=[WEATHER_TOOL])
    ).json()
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will look it up."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 18, "sky": "sunny"}'},
    ]
    second = tool_client.post(
        "/v1/chat/completions", json={"messages": history, "tools": [WEATHER_TOOL]}
    ).json()
    answer = second["choices"][0]
    assert answer["message"] == {"role": "assistant", "content": "It is 18C and sunny in Paris."}
    assert answer["finish_reason"] == "stop"


def test_tool_calls_streamed(tool_client) -> None:
    events = sse_payloads(
        tool_client.post(
            "/v1/chat/completions", json=chat("Weather?", tools=[WEATHER_TOOL], stream=True)
        ).text
    )
    content, name, arguments, call_ids = "", "", "", set()
    for event in events[:-1]:
        delta = event["choices"][0]["delta"]
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            assert call["index"] == 0
            call_ids.add(call.get("id"))
            name += call["function"].get("name", "")
            arguments += call["function"].get("arguments", "")
    assert content == "I will look it up."
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert len(call_ids - {None}) == 1
    assert (
        sum(bool(e["choices"][0]["delta"].get("tool_calls")) for e in events[:-1]) > 1
    )  # arguments streamed
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_text_alone(tool_client) -> None:
    body = tool_client.post(
        "/v1/chat/completions", json=chat(tools=[WEATHER_TOOL], tool_choice="none")
    ).json()
    assert body["choices"][0]["message"]["content"] == TOOL_OUTPUT
    assert body["choices"][0]["finish_reason"] == "stop"
