"""Requests that used to reach a 500 get a 400 naming the value, the limit and the fix; error messages
never quote internal exception text; /openapi.json declares what the server sends."""

from __future__ import annotations

import pytest

from tests.unit.server_helpers import build_test_client

KEY = "sk-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def client():
    test_client, _ = build_test_client(lambda prompt, index: "Paris.", api_key=KEY)
    with test_client:
        yield test_client


def post(client, path: str, body: dict | None = None, raw: str | None = None):
    if raw is not None:
        headers = HEADERS | {"Content-Type": "application/json"}
        return client.post(path, content=raw.encode(), headers=headers)
    return client.post(path, json=body, headers=HEADERS)


def error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("token", [-1, 10**30])
@pytest.mark.parametrize("prompt", [lambda t: [t, 5], lambda t: [[5], [t]]])
def test_echo_of_ids_outside_the_vocabulary_is_400(client, token: int, prompt) -> None:
    err = error(post(client, "/v1/completions", {"prompt": prompt(token), "echo": True, "max_tokens": 2}))
    assert f"token id {token}, outside the vocabulary [0, " in err["message"]
    assert err["param"] in ("prompt", "prompt[1]")


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/tokenize", '{"prompt": "a\\ud800"}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": "x\\ud800"}]}', "messages"),
    ],
)
def test_a_lone_surrogate_is_400(client, path: str, raw: str, param: str) -> None:
    err = error(post(client, path, raw=raw))
    assert "lone UTF-16 surrogate" in err["message"] and err["param"] == param


def test_a_message_quoting_a_lone_surrogate_is_still_sent(client) -> None:
    response = post(client, "/v1/completions", raw='{"prompt": "hi", "model": "\\ud800"}')
    assert response.status_code == 404 and "\\ud800" in response.text


def test_tokenize_with_no_messages_is_400(client) -> None:
    assert "messages is empty" in error(post(client, "/tokenize", {"messages": []}))["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
def test_an_empty_body_names_the_missing_field(client, path: str) -> None:
    err = error(post(client, path, raw=""))
    if path == "/tokenize":
        assert "the request body is empty: send a JSON object" in err["message"]
    else:
        required = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/detokenize": "tokens"}
        assert err["message"] == f"the request body is empty: send a JSON object with {required[path]}"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/detokenize", {"tokens": [True]}),
        ("/v1/completions", {"prompt": [1, True]}),
        ("/v1/completions", {"prompt": [[1, False]]}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [True]}),
    ],
)
def test_booleans_are_not_token_ids(client, path: str, body: dict) -> None:
    error(post(client, path, body))


def test_chat_template_kwargs_that_collide_are_400_without_internal_names(client) -> None:
    body = {"messages": [USER], "chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False}}
    err = error(post(client, "/v1/chat/completions", body))
    assert err["message"].startswith("chat_template_kwargs sets add_generation_prompt, tokenize, which")
    assert "apply_chat_template" not in err["message"] and err["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 - 1])
def test_a_seed_outside_64_bits_is_400(client, seed: int) -> None:
    err = error(post(client, "/v1/chat/completions", {"messages": [USER], "seed": seed, "n": 2}))
    assert f"seed={seed} is outside the range [-2**63, 2**63-1]" in err["message"] and err["param"] == "seed"


def test_detokenize_is_bounded_by_max_model_len(client) -> None:
    err = error(post(client, "/detokenize", {"tokens": [1] * 257}))
    assert err["message"].startswith(
        "tokens holds 257 ids, above the limit of 256 (the server's --max-model-len"
    )
    assert post(client, "/detokenize", {"tokens": [1] * 256}).status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "value", "message"),
    [
        ("/v1/chat/completions", "guided_choice", [], "choice is an empty list"),
        ("/v1/chat/completions", "guided_json", {"type": "thing"}, 'Unsupported type "thing"'),
        ("/v1/chat/completions", "guided_regex", "(ab", "The parenthesis is not closed"),
        ("/v1/chat/completions", "guided_grammar", "root ::= foo", 'Rule "foo" is not defined'),
        ("/v1/completions", "guided_choice", ["yes", ""], "every choice must be a non-empty string"),
        ("/v1/completions", "structured_outputs", {"choice": ["a"], "regex": "a"}, "takes one"),
        ("/v1/completions", "structural_tag", "{}", "structural_tag is not supported"),
        ("/v1/chat/completions", "response_format", {"type": "json_schema"}, "needs json_schema.schema"),
    ],
)
def test_bad_structured_output_requests_are_400(
    client, path: str, field: str, value: object, message: str
) -> None:
    body = {"messages": [USER]} if "chat" in path else {"prompt": "hi"}
    err = error(post(client, path, body | {field: value, "max_tokens": 2}))
    assert message in err["message"] and err["param"] == field, err


def test_openapi_declares_400_not_422_and_the_probe_bodies(client) -> None:
    spec = client.get("/openapi.json", headers=HEADERS).json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if "requestBody" in operation:
                schema = responses["400"]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for probe in ("/health", "/ping"):
        assert not spec["paths"][probe]["get"]["responses"]["200"].get("content")
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "401" in chat and "401" not in spec["paths"]["/health"]["get"]["responses"]
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


def test_405_carries_allow(client) -> None:
    response = client.put("/health", headers=HEADERS)
    assert response.status_code == 405 and response.headers["allow"] == "GET"
    response = client.delete("/v1/chat/completions", headers=HEADERS)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
