"""A request whose step ran out of GPU memory: a 503 with the engine's message (or, streamed, an error
event and then [DONE]); /health stays 200, the metrics count it as finished with reason "error", and
other requests, concurrent ones included, complete normally."""

from __future__ import annotations

import re
import threading
import time

import pytest

from tests.unit.oom_replay import OutOfMemoryReplayEngine
from tests.unit.server_helpers import build_test_client, sse_payloads

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
FAILING = "Please explode"


def failing_engine(step_delay_s: float = 0.0, after_tokens: int = 2) -> OutOfMemoryReplayEngine:
    return OutOfMemoryReplayEngine(
        lambda prompt, index: LONG,
        fails=lambda prompt: FAILING in prompt,
        after_tokens=after_tokens,
        step_delay_s=step_delay_s,
    )


@pytest.fixture(scope="module")
def served():
    engine = failing_engine()
    test_client, _ = build_test_client(lambda p, i: LONG, engine=engine)
    with test_client:
        yield test_client, engine


def chat(content: str, **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 50, **extra}


def completion(prompt: object, **extra: object) -> dict:
    return {"prompt": prompt, "max_tokens": 50, **extra}


def assert_out_of_memory_error(error: dict) -> None:
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    message = error["message"]
    assert re.match(r"Out of GPU memory in a step of [\d,]+ tokens over 1 sequences \(torch tried", message)
    assert "the server stays up" in message
    assert "--max-num-batched-tokens 4096 (now 8192" in message
    assert "--gpu-memory-utilization 0.85 (now 0.9" in message


def test_chat_and_completions_answer_503_with_the_message(served) -> None:
    client, _ = served
    for route, body in (
        ("/v1/chat/completions", chat(FAILING)),
        ("/v1/completions", completion(FAILING)),
        ("/v1/completions", completion(["Hello", FAILING])),  # one failed prompt fails the whole answer
    ):
        response = client.post(route, json=body)
        assert response.status_code == 503, (route, response.text)
        assert_out_of_memory_error(response.json()["error"])
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/chat/completions", json=chat("Hello")).json()
    assert ok["choices"][0]["message"]["content"] == LONG and ok["choices"][0]["finish_reason"] == "stop"
    ok = client.post("/v1/completions", json=completion("Hello")).json()
    assert ok["choices"][0]["text"] == LONG


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", chat(FAILING, stream=True, stream_options={"include_usage": True})),
        ("/v1/completions", completion(FAILING, stream=True)),
    ],
    ids=["chat", "completions"],
)
def test_a_stream_ends_with_an_error_event_then_done(served, route: str, body: dict) -> None:
    client, _ = served
    response = client.post(route, json=body)
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert_out_of_memory_error(payloads[-2]["error"])
    # Chunks before the failure (chat's role chunk always; tokens when the stream read them before the
    # final output arrived) are ordinary ones: no "error" finish_reason leaks into a choice.
    chunks = payloads[:-2]
    assert all("error" not in chunk for chunk in chunks)
    assert all(choice.get("finish_reason") is None for chunk in chunks for choice in chunk["choices"])
    assert client.get("/health").status_code == 200


def test_metrics_count_the_failure_as_finished_with_reason_error(served) -> None:
    client, _ = served
    client.post("/v1/chat/completions", json=chat(FAILING))
    text = client.get("/metrics").text
    failed = re.search(
        r'vllm:request_success_total\{engine="0",finished_reason="error",model_name="replay-model"\} (\d+)',
        text,
    )
    assert failed and int(failed[1]) >= 1
    assert 'vllm:num_requests_running{engine="0",model_name="replay-model"} 0.0' in text
    assert client.get("/health").status_code == 200


def test_a_concurrent_request_not_in_the_failed_step_completes() -> None:
    engine = failing_engine(step_delay_s=0.03, after_tokens=3)
    test_client, _ = build_test_client(lambda p, i: LONG, engine=engine)
    results: dict[str, object] = {}

    def post(name: str, body: dict) -> None:
        results[name] = test_client.post("/v1/chat/completions", json=body)

    with test_client:
        healthy = threading.Thread(target=post, args=("healthy", chat("Count for me")))
        healthy.start()
        deadline = time.monotonic() + 5
        while not engine.requests and time.monotonic() < deadline:
            time.sleep(0.005)
        failing = threading.Thread(target=post, args=("failing", chat(FAILING)))
        failing.start()
        healthy.join(10)
        failing.join(10)
        assert test_client.get("/health").status_code == 200
    (failed_ids, beside), *_ = engine.failed_steps
    assert len(failed_ids) == 1 and len(beside) == 1  # the healthy request was in flight, not in the step
    assert results["failing"].status_code == 503  # type: ignore[attr-defined]
    answer = results["healthy"].json()["choices"][0]  # type: ignore[attr-defined]
    assert (answer["message"]["content"], answer["finish_reason"]) == (LONG, "stop")
