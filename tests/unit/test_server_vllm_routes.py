"""vLLM's optional routes and headers, each behind its flag: /invocations (SageMaker), /load,
/tokenizer_info, X-Request-Id, --root-path with and without the prefix, and logprob tokens as
"token_id:N" (--return-tokens-as-token-ids or the request's field)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from fitserve.server.args import ServerSettings, add_server_args
from fitserve.server.extras import ServerLoad, ServerLoadMiddleware
from tests.unit.server_helpers import build_test_client, smollm2_tokenizer, sse_payloads

ANSWER = "The capital of France is Paris."


def make_client(**settings: object):
    test_client, _ = build_test_client(lambda prompt, index: ANSWER, **settings)
    return test_client


@pytest.fixture(scope="module")
def client():
    with make_client() as test_client:
        yield test_client


def test_invocations_routes_by_body(client) -> None:
    chat = client.post(
        "/invocations", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = client.post("/invocations", json={"prompt": "Hi", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    streamed = client.post("/invocations", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert sse_payloads(streamed.text)[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"input": "x"}, "cannot tell the request type", None),
        ({"prompt": "Hi", "temperature": "hot"}, "valid number", "temperature"),
        ({"messages": [{"role": "user", "content": "Hi"}], "top_p": 2}, "top_p=2.0 is outside", "top_p"),
    ],
)
def test_invocations_refusals(client, body: dict, message: str, param: str | None) -> None:
    response = client.post("/invocations", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == param


def test_optional_routes_are_off_by_default(client) -> None:
    assert client.get("/load").status_code == 404
    assert client.get("/tokenizer_info").status_code == 404
    assert "x-request-id" not in client.get("/v1/models").headers


def test_load_counts_generation_requests_in_flight() -> None:
    with make_client(enable_server_load_tracking=True) as test_client:
        assert test_client.get("/load").json() == {"server_load": 0}
        assert test_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        assert test_client.get("/load").json() == {"server_load": 0}


def test_load_middleware_counts_until_the_response_ends() -> None:
    load = ServerLoad()
    seen: list[int] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        seen.append(load.in_flight)

    middleware = ServerLoadMiddleware(app, load)
    for path, expected in (("/v1/completions", 1), ("/invocations", 1), ("/v1/models", 0)):
        asyncio.run(middleware({"type": "http", "path": path}, None, None))
        assert seen[-1] == expected
    assert load.in_flight == 0


def test_tokenizer_info() -> None:
    with make_client(enable_tokenizer_info_endpoint=True) as test_client:
        info = test_client.get("/tokenizer_info").json()
    tokenizer = smollm2_tokenizer()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"]["0"]["content"] == tokenizer.convert_ids_to_tokens(0)
    json.dumps(info)  # everything is JSON


def test_request_id_header_echoes_or_generates() -> None:
    with make_client(enable_request_id_headers=True) as test_client:
        echoed = test_client.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-123"}
        )
        assert echoed.headers["x-request-id"] == "abc-123"
        generated = test_client.get("/v1/models").headers["x-request-id"]
        assert len(generated) == 32
        assert test_client.get("/v1/models").headers["x-request-id"] != generated
        assert test_client.get("/nowhere").headers["x-request-id"]  # refusals carry one too


def test_root_path_serves_prefixed_and_stripped_paths() -> None:
    with make_client(root_path="/api/llm", api_key="sk-x") as test_client:
        auth = {"Authorization": "Bearer sk-x"}
        # a proxy that strips the prefix, as uvicorn then sees it, and a client that sends it
        assert test_client.get("/v1/models", headers=auth).status_code == 200
        assert test_client.get("/api/llm/v1/models", headers=auth).status_code == 200
        assert test_client.get("/api/llm/health").status_code == 200  # open route, no key
        assert test_client.get("/api/llm/v1/models").status_code == 401


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_tokens_as_token_ids_per_request_and_by_flag(route: str) -> None:
    tokenizer = smollm2_tokenizer()
    first = tokenizer.encode(ANSWER)[0]

    def body(**extra: object) -> dict:
        common: dict = {"max_tokens": 2, **extra}
        if route == "/v1/completions":
            return {"prompt": "Hi", "logprobs": 1, **common}
        return {
            "messages": [{"role": "user", "content": "Hi"}],
            "logprobs": True,
            "top_logprobs": 1,
            **common,
        }

    def first_token(response_body: dict) -> tuple[str, list[str]]:
        logprobs = response_body["choices"][0]["logprobs"]
        if route == "/v1/completions":
            return logprobs["tokens"][0], list(logprobs["top_logprobs"][0])
        entry = logprobs["content"][0]
        return entry["token"], [top["token"] for top in entry["top_logprobs"]]

    with make_client() as test_client:
        token, _ = first_token(test_client.post(route, json=body()).json())
        assert token == tokenizer.decode([first])
        token, tops = first_token(test_client.post(route, json=body(return_tokens_as_token_ids=True)).json())
        assert token == f"token_id:{first}"
        assert all(t.startswith("token_id:") for t in tops)
    with make_client(return_tokens_as_token_ids=True) as test_client:
        token, _ = first_token(test_client.post(route, json=body()).json())
        assert token == f"token_id:{first}"
        token, _ = first_token(test_client.post(route, json=body(return_tokens_as_token_ids=False)).json())
        assert token == tokenizer.decode([first])


def test_new_server_flags_parse() -> None:
    parser = add_server_args(argparse.ArgumentParser())
    flags = [
        "--return-tokens-as-token-ids",
        "--enable-tokenizer-info-endpoint",
        "--enable-server-load-tracking",
        "--enable-request-id-headers",
        "--disable-frontend-multiprocessing",
    ]
    settings = ServerSettings.from_namespace(parser.parse_args(flags))
    assert settings.return_tokens_as_token_ids and settings.enable_tokenizer_info_endpoint
    assert settings.enable_server_load_tracking and settings.enable_request_id_headers
    assert settings.disable_frontend_multiprocessing
    assert ServerSettings.from_namespace(parser.parse_args([])) == ServerSettings()
