"""The live server through the real openai SDK: chat and completions, streaming and not, n, seed,
stop, max_tokens, logprobs, echo, token-id prompts, vLLM's extra sampling fields, models."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import API_KEY, SERVED_NAMES, LiveServer

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == list(SERVED_NAMES)
    assert all(m.owned_by == "fitserve" for m in models.data)


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=8, temperature=0)
    assert response.object == "chat.completion" and response.model == "smol"
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert (
        usage.completion_tokens <= 8 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )
    alias = client.chat.completions.create(model="smol-alias", messages=QUESTION, max_tokens=8, temperature=0)
    assert alias.model == "smol-alias" and alias.choices[0].message.content == choice.message.content


def test_chat_stream_equals_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model="smol",
        messages=QUESTION,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_and_seed(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        response = client.chat.completions.create(
            model="smol", messages=QUESTION, max_tokens=6, temperature=1.0, n=2, seed=1234
        )
        assert [c.index for c in response.choices] == [0, 1]
        return [c.message.content for c in response.choices]

    first = sample()
    assert sample() == first  # a seeded request repeats itself
    assert all(first)


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        response = client.chat.completions.create(
            model="smol", messages=QUESTION, temperature=0, extra_body={"ignore_eos": True}, **limit
        )
        assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_stop_string(client: openai.OpenAI) -> None:
    free = client.completions.create(
        model="smol", prompt="The three primary colours are", max_tokens=12, temperature=0
    )
    text = free.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = client.completions.create(
        model="smol", prompt="The three primary colours are", max_tokens=12, temperature=0, stop=[stop]
    )
    choice = cut.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="smol", messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    assert "".join(e.token for e in entries) == response.choices[0].message.content
    for entry in entries:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy picks the most likely token
        assert entry.logprob <= 0


def test_completions_prompts_n_logprobs_echo(client: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The capital of France is"]
    response = client.completions.create(
        model="smol",
        prompt=prompts,
        n=2,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        assert "".join(choice.logprobs.tokens) == choice.text
        assert len(choice.logprobs.token_logprobs) == 4
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens == 16
    echoed = client.completions.create(
        model="smol", prompt=prompts[1], max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith(prompts[1])
    generated = echoed.choices[0].text[len(prompts[1]) :]
    assert generated and response.choices[2].text.startswith(generated)  # greedy: the same first tokens
    scored = client.completions.create(
        model="smol", prompt=prompts[1], max_tokens=1, temperature=0, echo=True, logprobs=3
    )
    logprobs = scored.choices[0].logprobs
    assert "".join(logprobs.tokens) == scored.choices[0].text  # prompt tokens decoded by the handler
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert all(3 <= len(top) <= 4 for top in logprobs.top_logprobs[1:])


def test_completion_stream_and_token_id_prompt(client: openai.OpenAI, live_server: LiveServer) -> None:
    import httpx

    ids = httpx.post(
        f"{live_server.url}/tokenize", json={"prompt": "The sky is"}, headers=live_server.headers
    ).json()["tokens"]
    whole = client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model="smol", prompt="The sky is", max_tokens=6, temperature=0)
    assert whole.choices[0].text == by_text.choices[0].text
    stream = client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == whole.choices[0].text


def test_vllm_extra_sampling_fields(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="smol",
        messages=QUESTION,
        max_tokens=4,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 4,
            "skip_special_tokens": True,
            "stop_token_ids": [2],
        },
    )
    assert response.usage.completion_tokens == 4


def test_errors_reach_the_sdk_as_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4o' does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="temperature=-1.0 is below the minimum 0"):
        client.chat.completions.create(model="smol", messages=QUESTION, temperature=-1)
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
