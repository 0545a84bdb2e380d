"""The live server over plain HTTP (httpx): auth, probes, docs, OpenAI-shaped errors, body cap,
tokenize/detokenize, metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import MAX_MODEL_LEN, LiveServer

pytestmark = pytest.mark.e2e


def chat(**extra: object) -> dict:
    return {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_probes_need_no_key_and_the_rest_does(live_server: LiveServer) -> None:
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(live_server.url + path).status_code == 200, path
    assert httpx.get(live_server.url + "/version").json()["version"]
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("GET", "/openapi.json"), ("GET", "/docs")):  # fmt: skip
        error = error_of(httpx.request(method, live_server.url + path, json={}), 401)
        assert error["type"] == "AuthenticationError" and "Authorization: Bearer" in error["message"]
    wrong = httpx.get(live_server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert "does not match" in error_of(wrong, 401)["message"]
    spec = httpx.get(live_server.url + "/openapi.json", headers=live_server.headers).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/metrics"} <= set(
        spec["paths"]
    )
    assert httpx.get(live_server.url + "/docs", headers=live_server.headers).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (chat(n=1000), "n", "n=1000 is above the limit 256"),
        (chat(max_tokens=5000), "max_tokens", f"maximum context length is {MAX_MODEL_LEN} tokens"),
        (
            chat(messages=[{"role": "user", "content": "word " * 1500}]),
            "messages",
            f"context length is {MAX_MODEL_LEN}",
        ),
        (chat(temperature="warm"), "temperature", "Input should be a valid number"),
        (chat(stop=[1, 2]), "stop", "stop must be a string or a list of strings"),
        (chat(prompt="x"), "prompt", "prompt is not a field of /v1/chat/completions"),
        (
            chat(
                tool_choice={"type": "function", "function": {"name": "g"}},
                tools=[{"function": {"name": "f"}}],
            ),
            "tool_choice",
            "tool_choice names the function 'g', which is not in tools",
        ),
    ],
)
def test_bad_chat_requests(live_server: LiveServer, body: dict, param: str, message: str) -> None:
    response = httpx.post(live_server.url + "/v1/chat/completions", json=body, headers=live_server.headers)
    error = error_of(response, 400)
    assert error["param"] == param and message in error["message"]


def test_malformed_json_and_wrong_shapes(live_server: LiveServer) -> None:
    headers = {**live_server.headers, "Content-Type": "application/json"}
    broken = httpx.post(live_server.url + "/v1/completions", content=b'{"prompt": "x",', headers=headers)
    assert error_of(broken, 400)["message"].startswith("the request body is not valid JSON")
    not_object = httpx.post(live_server.url + "/v1/completions", content=b"[1, 2]", headers=headers)
    assert error_of(not_object, 400)["message"].startswith("the request body must be a JSON object")
    misplaced = httpx.post(
        live_server.url + "/v1/completions", json={"prompt": "x", "messages": []}, headers=headers
    )
    assert error_of(misplaced, 400)["param"] == "messages"
    # the server still answers after all of these
    ok = httpx.post(
        live_server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers=headers,
        timeout=60,
    )
    assert ok.status_code == 200


def test_request_body_cap(live_server: LiveServer) -> None:
    huge = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    response = httpx.post(
        live_server.url + "/v1/completions",
        content=huge,
        headers={**live_server.headers, "Content-Type": "application/json"},
        timeout=60,
    )
    assert "above the limit of 16777216 bytes" in error_of(response, 413)["message"]


def test_tokenize_detokenize(live_server: LiveServer) -> None:
    tokens = httpx.post(
        live_server.url + "/tokenize", json={"prompt": "Hello world"}, headers=live_server.headers
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2 and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(
        live_server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=live_server.headers
    )
    assert text.json() == {"prompt": "Hello world"}


def test_metrics_after_traffic(live_server: LiveServer) -> None:
    httpx.post(live_server.url + "/v1/chat/completions", json=chat(), headers=live_server.headers, timeout=60)
    text = httpx.get(live_server.url + "/metrics").text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    lines = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("vllm:")
    }
    assert lines['vllm:generation_tokens_total{engine="0",model_name="smol"}'] >= 4
    assert lines['vllm:e2e_request_latency_seconds_count{engine="0",model_name="smol"}'] >= 1
    assert lines['vllm:request_success_total{engine="0",finished_reason="length",model_name="smol"}'] >= 1
    assert lines['vllm:iteration_tokens_total_count{engine="0",model_name="smol"}'] >= 4  # a step per token
    assert lines['vllm:request_prefill_time_seconds_count{engine="0",model_name="smol"}'] >= 1
    info = next(key for key in lines if key.startswith("vllm:cache_config_info{"))
    assert int(info.split('num_gpu_blocks="')[1].split('"')[0]) > 0 and lines[info] == 1.0
