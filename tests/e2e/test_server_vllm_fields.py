"""vLLM's extra request fields against a live `fitserve serve` (the default model, real sampler):
logit_bias, allowed_token_ids, prompt_logprobs, truncate_prompt_tokens and chat echo, through the openai
client's extra_body as vLLM's own tests send them."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import API_KEY, LiveServer

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy_tokens(client: openai.OpenAI, **extra: object) -> list[str]:
    response = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0, **extra
    )
    return response.choices[0].logprobs.tokens


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI) -> None:
    plain = greedy_tokens(client, extra_body={"return_tokens_as_token_ids": True})
    first_id = int(plain[0].split(":")[1])
    banned = greedy_tokens(
        client, logit_bias={str(first_id): -100}, extra_body={"return_tokens_as_token_ids": True}
    )
    assert banned[0] != plain[0]
    forced = greedy_tokens(client, logit_bias={"42": 100}, extra_body={"return_tokens_as_token_ids": True})
    assert forced == ["token_id:42"] * 3


def test_allowed_token_ids(client: openai.OpenAI) -> None:
    allowed = [1000, 2000, 3000]
    response = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=1.0,
        logprobs=True,
        extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True},
    )
    tokens = [entry.token for entry in response.choices[0].logprobs.content]
    assert tokens and {int(t.split(":")[1]) for t in tokens} <= set(allowed)


def test_prompt_logprobs_and_truncation(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model="smol",
        prompt=PROMPT,
        max_tokens=1,
        extra_body={"prompt_logprobs": 1, "truncate_prompt_tokens": 3},
    )
    assert response.usage.prompt_tokens == 3
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == 3 and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 2
        assert all(value["logprob"] <= 0 and value["rank"] >= 1 for value in entry.values())


def test_chat_echo_continues_the_assistant_message(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="smol",
        messages=[
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "It is"},
        ],
        max_tokens=4,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert response.choices[0].message.content.startswith("It is")
