"""The server's per-request bounds: --max-logprobs, prompt text refused before tokenizing, and the number of
prompts one /v1/completions request may send."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fitserve.server.context import MAX_PROMPT_CHARS_PER_TOKEN, MAX_PROMPTS_PER_REQUEST
from tests.unit.server_helpers import ReplayEngine, build_test_client, replay_config, smollm2_tokenizer

MAX_MODEL_LEN = 256


def _client(max_logprobs: int = 20) -> Any:
    config = replay_config(max_model_len=MAX_MODEL_LEN)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_logprobs=max_logprobs))
    engine = ReplayEngine(lambda prompt, index: "Paris.", config=config)
    test_client, _ = build_test_client(lambda prompt, index: "Paris.", engine=engine)
    return test_client


def _error(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_max_logprobs_bounds_logprobs_and_top_logprobs() -> None:
    with _client(max_logprobs=5) as client:
        error = _error(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 6}))
        assert error["param"] == "logprobs"
        assert error["message"] == (
            "logprobs=6 is above the server's limit of 5 log-probabilities per token (--max-logprobs): ask "
            "for 5 or fewer, or restart the server with a larger --max-logprobs"
        )
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
        error = _error(client.post("/v1/chat/completions", json={**chat, "top_logprobs": 6}))
        assert error["param"] == "top_logprobs" and "limit of 5" in error["message"]
        echo = {"prompt": "Hi there", "max_tokens": 1, "logprobs": 5, "echo": True}
        assert client.post("/v1/completions", json=echo).status_code == 200


def test_max_logprobs_minus_one_is_the_vocabulary() -> None:
    with _client(max_logprobs=-1) as client:
        body = {"prompt": "Hi", "max_tokens": 1, "logprobs": 21}
        assert client.post("/v1/completions", json=body).status_code == 200
        body["logprobs"] = len(smollm2_tokenizer()) + 1
        assert "limit of" in _error(client.post("/v1/completions", json=body))["message"]


def test_prompt_text_far_beyond_the_context_is_refused_before_tokenizing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limit = MAX_MODEL_LEN * MAX_PROMPT_CHARS_PER_TOKEN
    tokenizer = smollm2_tokenizer()
    encoded: list[int] = []
    original = tokenizer.encode

    def counting_encode(text: str, *args: Any, **kwargs: Any) -> Any:
        encoded.append(len(text))
        return original(text, *args, **kwargs)

    with _client() as client:
        monkeypatch.setattr(tokenizer, "encode", counting_encode)
        error = _error(client.post("/v1/completions", json={"prompt": "a" * (limit + 1), "max_tokens": 1}))
        assert error["param"] == "prompt"
        assert error["message"] == (
            f"prompt has {limit + 1} characters, above the limit of {limit} ({MAX_MODEL_LEN} tokens of "
            f"--max-model-len x {MAX_PROMPT_CHARS_PER_TOKEN} characters per token), far more than this "
            f"model's context holds: shorten it to fit {MAX_MODEL_LEN - 1} tokens"
        )
        assert not encoded
        many = {"prompt": ["Hi", "b" * (limit + 1)], "max_tokens": 1}
        assert _error(client.post("/v1/completions", json=many))["param"] == "prompt"
        chat = {"messages": [{"role": "user", "content": "c" * limit}], "max_tokens": 1}
        assert _error(client.post("/v1/chat/completions", json=chat))["param"] == "messages"
        assert all(length <= limit for length in encoded)
        tokenize = client.post("/tokenize", json={"prompt": "d" * (limit + 1)})
        assert "characters, above the limit" in _error(tokenize)["message"]


def test_prompts_per_completions_request_are_capped() -> None:
    with _client() as client:
        body = {"prompt": ["Hi"] * (MAX_PROMPTS_PER_REQUEST + 1), "max_tokens": 1}
        error = _error(client.post("/v1/completions", json=body))
        assert error["param"] == "prompt"
        assert error["message"] == (
            f"prompt holds {MAX_PROMPTS_PER_REQUEST + 1} prompts, above the limit of "
            f"{MAX_PROMPTS_PER_REQUEST} per request: send them in requests of at most "
            f"{MAX_PROMPTS_PER_REQUEST} prompts"
        )
        ids = {"prompt": [[1, 2]] * (MAX_PROMPTS_PER_REQUEST + 1), "max_tokens": 1}
        assert _error(client.post("/v1/completions", json=ids))["param"] == "prompt"
        ok = {"prompt": ["Hi", "There"], "max_tokens": 1}
        assert len(client.post("/v1/completions", json=ok).json()["choices"]) == 2
