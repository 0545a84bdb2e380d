"""vLLM's request fields that its own OpenAI-server tests use: logit_bias, allowed_token_ids,
prompt_logprobs, truncate_prompt_tokens, chat echo, custom chat roles, continuous usage stats, and
use_beam_search with a field it does not use refused. Recorded outputs are replayed
(tests/unit/server_helpers.py); what reaches the engine is recorded."""

from __future__ import annotations

import math

import pytest

from fitserve.core.outputs import Logprob, RequestOutput
from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.detokenizer import decode_token
from tests.unit.server_helpers import ReplayEngine, build_test_client, smollm2_tokenizer, sse_payloads

ANSWER = "The capital of France is Paris."


class RecordingEngine(ReplayEngine):
    """Records each request's prompt and params; answers prompt_logprobs like the engine does (None for
    the first position, then the prompt token with rank 2 and the top-k, ids counted up from 0)."""

    def __init__(self) -> None:
        super().__init__(lambda prompt, index: ANSWER)
        self.seen: list[tuple[str | None, list[int], SamplingParams]] = []

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> None:
        super().add_request(request_id, prompt, prompt_token_ids, params)
        self.seen.append((prompt, list(prompt_token_ids or []), params))

    def _output(self, replay, finished: bool) -> RequestOutput:  # type: ignore[no-untyped-def]
        output = super()._output(replay, finished)
        num_top = replay.params.prompt_logprobs
        if num_top is not None:
            positions: list[dict[int, Logprob] | None] = [None]
            for token in replay.prompt_token_ids[1:]:
                entries = {token: Logprob(math.log(0.25), 2, decode_token(self.tokenizer, token))}
                for k in range(num_top):
                    entries.setdefault(k, Logprob(-float(k + 1), k + 1, decode_token(self.tokenizer, k)))
                positions.append(entries)
            output.prompt_logprobs = positions
        return output


@pytest.fixture(scope="module")
def served():
    engine = RecordingEngine()
    test_client, _ = build_test_client(lambda p, i: ANSWER, engine=engine)
    with test_client:
        yield test_client, engine


def last_params(engine: RecordingEngine) -> SamplingParams:
    return engine.seen[-1][2]


def chat(text: str = "Capital of France?", **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def completion(**extra: object) -> dict:
    return {"prompt": "Capital of France?", "max_tokens": 4, **extra}


ROUTES = [("/v1/chat/completions", chat), ("/v1/completions", completion)]


@pytest.mark.parametrize(("route", "body"), ROUTES)
def test_logit_bias_and_allowed_token_ids_reach_the_engine(served, route: str, body) -> None:
    client, engine = served
    response = client.post(
        route, json=body(logit_bias={"42": 5, "7": -250.5, "9": 300}, allowed_token_ids=[42, 7, 1000])
    )
    assert response.status_code == 200, response.text
    params = last_params(engine)
    # keys become token ids; values outside OpenAI's [-100, 100] are clamped, as vLLM does
    assert params.logit_bias == {42: 5.0, 7: -100.0, 9: 100.0}
    assert params.allowed_token_ids == [7, 42, 1000]


@pytest.mark.parametrize(("route", "body"), ROUTES)
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"logit_bias": {"forty": 1}}, "logit_bias", "logit_bias has the key 'forty'"),
        (
            {"logit_bias": {"49152": 1}},
            "logit_bias",
            "logit_bias holds token id 49152, outside the vocabulary",
        ),
        ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is empty"),
        ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids", "allowed_token_ids holds token id 1000000"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop", "is not used by beam search"),
        ({"truncate_prompt_tokens": 257}, "truncate_prompt_tokens", "greater than max_model_len=256"),
    ],
)
def test_bad_values_are_400s(served, route: str, body, fields: dict, param: str, message: str) -> None:
    client, _ = served
    response = client.post(route, json=body(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    assert error["param"] == param


def test_prompt_logprobs_null_unless_asked(served) -> None:
    client, _ = served
    body = client.post("/v1/completions", json=completion()).json()
    assert body["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_shape(served) -> None:
    client, engine = served
    prompt = [19556, 905, 314]
    body = client.post("/v1/completions", json=completion(prompt=prompt, prompt_logprobs=2, n=2)).json()
    assert last_params(engine).prompt_logprobs == 2
    tokenizer = smollm2_tokenizer()
    for choice in body["choices"]:
        entries = choice["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        for token, entry in zip(prompt[1:], entries[1:], strict=True):
            assert set(entry) == {str(token), "0", "1"}  # JSON keys: the token ids
            assert entry[str(token)] == {
                "logprob": pytest.approx(math.log(0.25)),
                "rank": 2,
                "decoded_token": tokenizer.decode([token]),
            }
            assert entry["0"]["rank"] == 1
    assert body["choices"][0]["logprobs"] is None  # generated-token logprobs stay separate


def test_prompt_logprobs_with_echo_keeps_echo_logprobs(served) -> None:
    client, engine = served
    body = client.post(
        "/v1/completions", json=completion(prompt=[19556, 905], echo=True, logprobs=1, prompt_logprobs=0)
    ).json()
    assert last_params(engine).prompt_logprobs == 0
    choice = body["choices"][0]
    assert choice["logprobs"]["token_logprobs"][0] is None  # the echoed prompt's first token
    assert len(choice["prompt_logprobs"]) == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs are not available when stream=true"),
        ({"prompt_logprobs": -2}, "prompt_logprobs=-2 is not allowed"),
        ({"prompt_logprobs": -1}, "prompt_logprobs=49152 is above the server's limit of 20"),
        ({"prompt_logprobs": 21}, "prompt_logprobs=21 is above the server's limit of 20"),
    ],
)
def test_prompt_logprobs_refusals(served, fields: dict, message: str) -> None:
    client, _ = served
    response = client.post("/v1/completions", json=completion(**fields))
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens_keeps_the_last_tokens(served) -> None:
    client, engine = served
    ids = list(range(100, 110))
    body = client.post("/v1/completions", json=completion(prompt=ids, truncate_prompt_tokens=3)).json()
    assert engine.seen[-1][1] == [107, 108, 109]
    assert body["usage"]["prompt_tokens"] == 3
    text = client.post("/v1/completions", json=completion(truncate_prompt_tokens=2)).json()
    assert text["usage"]["prompt_tokens"] == 2
    tokenizer = smollm2_tokenizer()
    assert engine.seen[-1][1] == tokenizer.encode("Capital of France?")[-2:]
    whole = client.post("/v1/completions", json=completion(prompt=ids, truncate_prompt_tokens=-1)).json()
    assert whole["usage"]["prompt_tokens"] == 10  # -1: as much as the context holds


def test_truncate_prompt_tokens_on_chat(served) -> None:
    client, engine = served
    full = client.post("/v1/chat/completions", json=chat()).json()["usage"]["prompt_tokens"]
    assert full > 5
    body = client.post("/v1/chat/completions", json=chat(truncate_prompt_tokens=5)).json()
    assert body["usage"]["prompt_tokens"] == 5
    assert len(engine.seen[-1][1]) == 5


def continue_body(**extra: object) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Sure! "},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 3,
        **extra,
    }


def test_chat_echo_starts_the_reply_with_the_last_message(served) -> None:
    client, _ = served
    tokenizer = smollm2_tokenizer()
    generated = tokenizer.decode(tokenizer.encode(ANSWER)[:3])
    echoed = client.post("/v1/chat/completions", json=continue_body(echo=True)).json()
    assert echoed["choices"][0]["message"]["content"] == "Sure! " + generated
    plain = client.post("/v1/chat/completions", json=continue_body()).json()
    assert plain["choices"][0]["message"]["content"] == generated
    # the last message is the user's and a generation prompt follows: nothing to echo
    user_last = client.post("/v1/chat/completions", json=chat(echo=True, max_tokens=3)).json()
    assert user_last["choices"][0]["message"]["content"] == generated


def test_chat_echo_streamed(served) -> None:
    client, _ = served
    events = sse_payloads(
        client.post("/v1/chat/completions", json=continue_body(echo=True, stream=True)).text
    )
    assert events[-1] == "[DONE]"
    contents = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e["choices"]]
    assert contents[0] == ""  # the role chunk
    assert contents[1] == "Sure! "
    tokenizer = smollm2_tokenizer()
    assert "".join(c or "" for c in contents) == "Sure! " + tokenizer.decode(tokenizer.encode(ANSWER)[:3])


def test_custom_roles_reach_the_template(served) -> None:
    client, engine = served
    body = {
        "messages": [
            {"role": "user", "content": "Run it."},
            {"role": "ipython", "content": "42"},
        ],
        "max_tokens": 2,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert "<|im_start|>ipython\n42<|im_end|>" in (engine.seen[-1][0] or "")


@pytest.mark.parametrize(("route", "body"), ROUTES)
def test_continuous_usage_stats_in_every_chunk(served, route: str, body) -> None:
    client, _ = served
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = sse_payloads(client.post(route, json=body(stream=True, stream_options=options)).text)[:-1]
    assert events and all("usage" in event for event in events)
    choice_events = [e for e in events if e["choices"]]
    usages = [e["usage"] for e in choice_events]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert usages[-1]["completion_tokens"] == 4
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts)
    assert not events[-1]["choices"] and events[-1]["usage"]["completion_tokens"] == 4  # the final one
    # include_usage alone: usage only in the last chunk
    only_final = sse_payloads(
        client.post(route, json=body(stream=True, stream_options={"include_usage": True})).text
    )[:-1]
    assert [("usage" in e) for e in only_final] == [False] * (len(only_final) - 1) + [True]
