"""Routes, errors in OpenAI's shape, auth, CORS and the body cap, on the real app over a ReplayEngine."""

from __future__ import annotations

import argparse

import pytest

from fitserve.server.args import ServerSettings, add_server_args
from tests.unit.server_helpers import build_test_client

ANSWER = "Paris is the capital of France."


@pytest.fixture(scope="module")
def client():
    test_client, _ = build_test_client(lambda prompt, index: ANSWER)
    with test_client:
        yield test_client


def chat_body(**extra: object) -> dict:
    return {"model": "replay-model", "messages": [{"role": "user", "content": "Capital of France?"}], **extra}


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == response.status_code
    return body["error"]


def test_probes_and_models(client) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200
    assert client.get("/version").json()["version"]
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["replay-model", "replay-alias"]
    assert models["data"][0]["max_model_len"] == 256 and models["object"] == "list"


def test_every_served_name_is_accepted_and_others_are_404(client) -> None:
    assert (
        client.post("/v1/chat/completions", json=chat_body(model="replay-alias")).json()["model"]
        == "replay-alias"
    )
    response = client.post("/v1/chat/completions", json=chat_body(model="gpt-4"))
    assert response.status_code == 404
    error = error_of(response)
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    assert error["message"].startswith("The model 'gpt-4' does not exist")


@pytest.mark.parametrize(
    ("route", "body", "param", "message"),
    [
        (
            "/v1/chat/completions",
            chat_body(temperature="hot"),
            "temperature",
            "Input should be a valid number",
        ),
        ("/v1/chat/completions", chat_body(messages=[]), "messages", "at least 1 item"),
        (
            "/v1/chat/completions",
            chat_body(messages=[{"role": "", "content": "x"}]),
            "messages[0].role",
            "at least 1 character",
        ),
        (
            "/v1/chat/completions",
            chat_body(messages=[{"role": "user"}]),
            "messages[0]",
            "a user message needs content",
        ),
        (
            "/v1/chat/completions",
            chat_body(prompt="x"),
            "prompt",
            "prompt is not a field of /v1/chat/completions",
        ),
        ("/v1/chat/completions", chat_body(n=9), "n", "n=9 is above the limit 8"),
        (
            "/v1/chat/completions",
            chat_body(max_tokens=300),
            "max_tokens",
            "max_tokens=300 is more than the context",
        ),
        (
            "/v1/chat/completions",
            chat_body(max_completion_tokens=0),
            "max_tokens",
            "max_tokens=0 is below the minimum 1",
        ),
        (
            "/v1/chat/completions",
            chat_body(logprobs=True, top_logprobs=21),
            "top_logprobs",
            "top_logprobs=21 is above the server's limit of 20 log-probabilities per token (--max-logprobs)",
        ),
        ("/v1/chat/completions", chat_body(top_p=1.5), "top_p", "top_p=1.5 is outside the range (0, 1]"),
        (
            "/v1/chat/completions",
            chat_body(stream_options={"include_usage": True}),
            "stream_options",
            "only allowed with stream=true",
        ),
        (
            "/v1/chat/completions",
            chat_body(stream=True, stream_options={"usage": 1}),
            "stream_options.usage",
            "Extra inputs",
        ),
        (
            "/v1/chat/completions",
            chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format",
            "needs json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            chat_body(messages=[{"role": "user", "content": "x " * 300}]),
            "messages",
            "maximum context length is 256",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "messages": []},
            "messages",
            "messages is not a field of /v1/completions",
        ),
        (
            "/v1/chat/completions",
            chat_body(chat_template="{{ 1 }}"),
            "chat_template",
            "--trust-request-chat-template",
        ),
        ("/v1/completions", {"prompt": 5}, "prompt", "prompt must be a string, a list of strings"),
        ("/v1/completions", {"prompt": [1, 99999999]}, "prompt", "token id 99999999, outside the vocabulary"),
        (
            "/v1/completions",
            {"prompt": "x", "logprobs": 50},
            "logprobs",
            "logprobs=50 is above the server's limit of 20",
        ),
        ("/v1/completions", {}, "prompt", "prompt is required"),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    client, route: str, body: dict, param: str, message: str
) -> None:
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "BadRequestError"
    assert error["param"] == param
    assert message in error["message"]


def test_malformed_json_is_400(client) -> None:
    response = client.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert error_of(response)["message"].startswith("the request body is not valid JSON")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (chat_body(tool_choice="required"), 'tool_choice "required" needs tools'),
        (
            chat_body(
                tool_choice={"type": "function", "function": {"name": "g"}},
                tools=[{"type": "function", "function": {"name": "f"}}],
            ),
            "tool_choice names the function 'g', which is not in tools (offered: 'f')",
        ),
        (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "--enable-auto-tool-choice"),
    ],
)
def test_unsupported_tool_choice_is_400(client, body: dict, message: str) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert message in error_of(response)["message"]


def test_unknown_route_and_method_are_openai_errors(client) -> None:
    assert error_of(client.get("/v2/nothing"))["type"] == "NotFoundError"
    assert client.get("/v1/chat/completions").status_code == 405


def test_tokenize_and_detokenize(client) -> None:
    tokens = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokens["tokens"] == [19556, 905] and tokens["count"] == 2 and tokens["max_model_len"] == 256
    assert tokens["token_strs"] == ["Hello", "Ġworld"]
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 10
    both = client.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "Hi"}]})
    assert "exactly one of prompt" in error_of(both)["message"]
    assert "outside the vocabulary" in error_of(client.post("/detokenize", json={"tokens": [-1]}))["message"]


VLLM_LABELS = 'engine="0",model_name="replay-model"'


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_use_vllm_names_types_and_labels(client) -> None:
    before = _samples(client.get("/metrics").text)
    client.post("/v1/chat/completions", json=chat_body())
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 2})
    text = client.get("/metrics").text
    after = _samples(text)
    types = {
        "num_requests_running": "gauge",
        "num_requests_waiting": "gauge",
        "kv_cache_usage_perc": "gauge",
        "cache_config_info": "gauge",
        "prompt_tokens_total": "counter",
        "generation_tokens_total": "counter",
        "prefix_cache_queries_total": "counter",
        "prefix_cache_hits_total": "counter",
        "num_preemptions_total": "counter",
        "request_success_total": "counter",
    }
    for name in (
        "iteration_tokens_total",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
    ):
        types[name] = "histogram"
    for name, kind in types.items():
        assert f"# TYPE vllm:{name} {kind}\n" in text, name
    assert not [line for line in text.splitlines() if "fitserve:" in line]  # no duplicate copies
    for key in after:
        if key.startswith("vllm:") and not key.startswith("vllm:cache_config_info"):
            assert 'engine="0"' in key and 'model_name="replay-model"' in key, key
    assert after[f"vllm:num_requests_running{{{VLLM_LABELS}}}"] == 0.0
    info = next(key for key in after if key.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="64"' in info and 'engine="0"' in info
    assert after[info] == 1.0

    def moved(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert moved(f"vllm:e2e_request_latency_seconds_count{{{VLLM_LABELS}}}") == 2
    assert (
        moved('vllm:request_success_total{engine="0",finished_reason="stop",model_name="replay-model"}') >= 1
    )
    assert moved(f"vllm:generation_tokens_total{{{VLLM_LABELS}}}") > 0
    assert moved(f"vllm:prompt_tokens_total{{{VLLM_LABELS}}}") > 0

    def bucket(name: str, le: str) -> str:
        return f'vllm:{name}_bucket{{engine="0",le="{le}",model_name="replay-model"}}'

    assert moved(bucket("request_params_n", "1.0")) == 1  # the chat request
    assert moved(bucket("request_params_n", "2.0")) == 2
    assert moved(bucket("request_params_max_tokens", "5.0")) == 1  # the completion's max_tokens 3
    assert moved(f"vllm:time_to_first_token_seconds_count{{{VLLM_LABELS}}}") == 2


def test_api_key_guards_all_but_probes() -> None:
    test_client, _ = build_test_client(lambda prompt, index: ANSWER, api_key="s3cret")
    with test_client as client:
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert client.get(path).status_code == 200, path
        missing = client.get("/v1/models")
        assert missing.status_code == 401
        assert error_of(missing)["message"].startswith("unauthorized: no Authorization header was sent")
        wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert "the API key does not match" in error_of(wrong)["message"]
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        ok = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == ANSWER


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = add_server_args(argparse.ArgumentParser())
    monkeypatch.delenv("FITSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert ServerSettings.from_namespace(parser.parse_args([])).api_key == "from-vllm"
    monkeypatch.setenv("FITSERVE_API_KEY", "from-fitserve")
    assert ServerSettings.from_namespace(parser.parse_args([])).api_key == "from-fitserve"
    assert ServerSettings.from_namespace(parser.parse_args(["--api-key", "flag"])).api_key == "flag"


def test_server_flags_are_checked(tmp_path) -> None:
    parser = add_server_args(argparse.ArgumentParser())
    settings = ServerSettings.from_namespace(parser.parse_args([]))
    assert (settings.host, settings.port, settings.exposed_without_key) == ("127.0.0.1", 8000, False)
    exposed = ServerSettings.from_namespace(parser.parse_args(["--host", "0.0.0.0"]))
    assert exposed.exposed_without_key and exposed.base_url == "http://127.0.0.1:8000"
    with pytest.raises(
        ValueError, match="--enable-auto-tool-choice needs a parser: add --tool-call-parser gemma4 or hermes"
    ):
        ServerSettings.from_namespace(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(ValueError, match="TLS needs both --ssl-keyfile and --ssl-certfile"):
        ServerSettings.from_namespace(parser.parse_args(["--ssl-keyfile", str(tmp_path / "k.pem")]))
    with pytest.raises(ValueError, match="--max-request-body-bytes 10 is below the minimum 1024"):
        ServerSettings.from_namespace(parser.parse_args(["--max-request-body-bytes", "10"]))


def test_cors_answers_preflight_for_allowed_origins() -> None:
    test_client, _ = build_test_client(
        lambda prompt, index: ANSWER, allowed_origins=["http://app.example"], api_key="k"
    )
    headers = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    with test_client as client:
        preflight = client.options("/v1/chat/completions", headers=headers)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        refused = client.options("/v1/chat/completions", headers={**headers, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in refused.headers
        unauthorized = client.get("/v1/models", headers={"Origin": "http://app.example"})
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == "http://app.example"


def test_request_body_cap() -> None:
    test_client, _ = build_test_client(lambda prompt, index: ANSWER, max_request_body_bytes=2048)
    with test_client as client:
        response = client.post("/v1/chat/completions", json=chat_body(user="x" * 4096))
        assert response.status_code == 413
        assert "above the limit of 2048 bytes" in error_of(response)["message"]
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200

        def chunks():
            yield b'{"messages": [{"role": "user", "content": "'
            yield b"y" * 4096
            yield b'"}]}'

        streamed = client.post(
            "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert streamed.status_code == 413
        assert "more than 2048 bytes" in error_of(streamed)["message"]


def test_server_flags_from_yaml_and_cors_list_forms(tmp_path) -> None:
    from fitserve.cli.main import parse_command

    config = tmp_path / "config.yaml"
    config.write_text(
        "port: 8131\napi-key: from-yaml\nallowed-origins: ['http://a.example']\n"
        "enable-auto-tool-choice: true\ntool-call-parser: hermes\nserved-model-name: [a, b]\n"
    )
    _, _, namespace = parse_command(["serve", "--config", str(config), "--port", "9000"])
    settings = ServerSettings.from_namespace(namespace)
    assert (settings.port, settings.api_key, settings.allowed_origins) == (
        9000,
        "from-yaml",
        ["http://a.example"],
    )
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    assert namespace.served_model_name == ["a", "b"]
    parser = add_server_args(argparse.ArgumentParser())
    as_json = ServerSettings.from_namespace(
        parser.parse_args(["--allowed-origins", '["http://a", "http://b"]'])
    )
    as_items = ServerSettings.from_namespace(parser.parse_args(["--allowed-methods", "GET", "POST"]))
    assert as_json.allowed_origins == ["http://a", "http://b"] and as_items.allowed_methods == ["GET", "POST"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--allowed-origins", "[not json"])
