"""32 concurrent streams against the live server, 8 of which hang up halfway: the other 24 finish,
and afterwards nothing runs and no KV block is held (the 8 were aborted and their blocks freed)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.e2e.conftest import LiveServer

pytestmark = pytest.mark.e2e

NUM_STREAMS = 32
NUM_HANGING_UP = 8
MAX_TOKENS = 12


ABORTED = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="smol"}'


def metric(text: str, name: str, default: float | None = None) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"{name} is not in /metrics")


async def one_stream(
    client: httpx.AsyncClient, server: LiveServer, index: int, hang_up: bool
) -> tuple[str, int]:
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": f"Tell me a fact about the number {index}."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "logprobs": True,  # one entry per token: counts the tokens of chunks that carry several
        "stream": True,
    }
    num_tokens = 0
    finish_reason = "none"
    async with client.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=server.headers
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return finish_reason, num_tokens
            if not line.startswith("data: "):
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            num_tokens += len((choice["logprobs"] or {}).get("content") or [])
            finish_reason = choice["finish_reason"] or finish_reason
            if hang_up and num_tokens >= MAX_TOKENS // 2:
                return "hung up", num_tokens
    return "no [DONE]", num_tokens


def test_concurrent_streams_with_disconnects(live_server: LiveServer) -> None:
    aborted_before = metric(httpx.get(live_server.url + "/metrics").text, ABORTED, default=0.0)

    async def run_all() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(one_stream(client, live_server, i, i < NUM_HANGING_UP) for i in range(NUM_STREAMS))
            )

    results = asyncio.run(run_all())
    assert [r[0] for r in results[:NUM_HANGING_UP]] == ["hung up"] * NUM_HANGING_UP
    completed = results[NUM_HANGING_UP:]
    assert [r[0] for r in completed] == ["length"] * (NUM_STREAMS - NUM_HANGING_UP)
    assert [num_tokens for _, num_tokens in completed] == [MAX_TOKENS] * (NUM_STREAMS - NUM_HANGING_UP)

    text = wait_until_idle(live_server, timeout_s=10)
    running = metric(text, "vllm:num_requests_running")
    usage = metric(text, "vllm:kv_cache_usage_perc")
    assert (running, usage, metric(text, "vllm:num_requests_waiting")) == (0.0, 0.0, 0.0)
    assert metric(text, ABORTED) - aborted_before == NUM_HANGING_UP


def wait_until_idle(server: LiveServer, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.url + "/metrics").text
        idle = (metric(text, "vllm:num_requests_running"), metric(text, "vllm:kv_cache_usage_perc"))
        if idle == (0.0, 0.0) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_a_client_that_gives_up_on_a_whole_response_aborts_it(live_server: LiveServer) -> None:
    aborted_before = metric(httpx.get(live_server.url + "/metrics").text, ABORTED, default=0.0)
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.url + "/v1/completions", json=body, headers=live_server.headers, timeout=1)
    started = time.monotonic()
    text = wait_until_idle(live_server, timeout_s=10)
    assert metric(text, "vllm:num_requests_running") == 0.0, "the abandoned request kept running"
    assert metric(text, ABORTED) - aborted_before == 1
    assert time.monotonic() - started < 10  # 1000 tokens take far longer
