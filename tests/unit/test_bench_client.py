"""bench serve's HTTP client: stream parsing, timing, failures, concurrency and the whole run.

The server here is `FakeOpenAIServer`, an in-process test double (an httpx transport, no socket) that
speaks the OpenAI streaming format with controlled delays, so the client's arithmetic and failure
handling can be checked exactly. It exists only in this file; tests/e2e/test_bench_serve.py runs the
benchmark against the real fitserve server.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from typing import Any

import httpx
import numpy as np
import pytest

from fitserve.arg_parser import FlexibleArgumentParser
from fitserve.bench.cli_bench import _add_bench_parsers
from fitserve.bench.client import RequestInput, SSELines, send_request
from fitserve.bench.serve import arrival_offsets, run_requests, run_serve_benchmark
from tests.paths import SMOLLM2_TOKENIZER_DIR

SMOLLM2_TOKENIZER = str(SMOLLM2_TOKENIZER_DIR)
FIRST_TOKEN_DELAY = 0.05
TOKEN_GAP = 0.01


class FakeOpenAIServer:
    """Streams `max_tokens` one-word chunks; markers in the prompt make it fail in chosen ways."""

    def __init__(self, send_usage: bool = True) -> None:
        self.send_usage = send_usage
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "root": None}]})
        if request.method == "GET" and request.url.path == "/version":
            return httpx.Response(200, json={"version": "fake-1.0"})
        if request.method == "GET":  # /metrics and the rest: not served, as a server without them answers
            return httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        if "HTTP500" in prompt:
            return httpx.Response(500, json={"error": {"message": "engine fell over", "code": 500}})
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, content=self._events(body, prompt))

    async def _events(self, body: dict[str, Any], prompt: str):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            chat = "messages" in body
            num_tokens = body.get("max_tokens") or body["max_completion_tokens"]
            if chat:  # a role-only chunk before any token: must not count as the first token
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            yield b": keep-alive comment\n\n"
            await asyncio.sleep(FIRST_TOKEN_DELAY)
            for index in range(num_tokens):
                if index:
                    await asyncio.sleep(TOKEN_GAP)
                if "TRUNCATE" in prompt and index == 2:
                    return
                if "STREAMERR" in prompt and index == 1:
                    yield sse({"error": {"message": "out of KV blocks", "code": 500}})
                    return
                if "SLOW" in prompt:
                    await asyncio.sleep(5)
                text = "" if "SILENT" in prompt and index < 2 else " word"  # tokens that add no text yet
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield sse({"choices": [{**choice, "finish_reason": None}]})
            last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            yield sse({"choices": [{**last, "finish_reason": "length"}]})
            if self.send_usage:
                usage = {
                    "prompt_tokens": 11,
                    "completion_tokens": num_tokens,
                    "total_tokens": 11 + num_tokens,
                }
                yield sse({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def request_input(
    prompt: str, backend: str = "openai", output_len: int = 5, timeout_s: float = 30.0
) -> RequestInput:
    path = "/v1/completions" if backend == "openai" else "/v1/chat/completions"
    return RequestInput(
        backend=backend,
        api_url=f"http://fake{path}",
        model="fake-model",
        prompt=prompt,
        prompt_len=3,
        output_len=output_len,
        sampling={"temperature": 0.0, "ignore_eos": True},
        headers={},
        timeout_s=timeout_s,
    )


async def send(server: FakeOpenAIServer, request: RequestInput):
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
        return await send_request(client, request)


def test_completion_stream_is_timed_chunk_by_chunk():
    server = FakeOpenAIServer()
    result = asyncio.run(send(server, request_input("hello", output_len=5)))
    assert result.success, result.error
    assert FIRST_TOKEN_DELAY <= result.ttft < FIRST_TOKEN_DELAY + 1.0
    # 5 token chunks and the finish chunk (a choice with empty text: counted, as vLLM counts it); the
    # usage chunk carries no token
    assert len(result.itl) == 5
    assert all(gap >= TOKEN_GAP * 0.9 for gap in result.itl[:4])
    assert result.latency == pytest.approx(result.ttft + sum(result.itl))
    assert result.generated_text == " word" * 5
    assert (result.usage_completion_tokens, result.prompt_len) == (5, 11)
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["temperature"]) == (5, True, 0.0)


def test_chat_role_chunk_does_not_count_as_first_token():
    server = FakeOpenAIServer()
    result = asyncio.run(send(server, request_input("hello", backend="openai-chat", output_len=3)))
    assert result.success, result.error
    assert result.ttft >= FIRST_TOKEN_DELAY
    assert len(result.itl) == 3  # 3 content chunks and the finish chunk; the role chunk is not a token
    body = server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["max_completion_tokens"] == 3 and "max_tokens" not in body


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_tokens_that_add_no_text_still_time_the_first_token(backend: str):
    """The first two tokens arrive as chunks with empty text: TTFT is the first of them, as in vLLM."""
    result = asyncio.run(send(FakeOpenAIServer(), request_input("SILENT", backend=backend, output_len=4)))
    assert result.success, result.error
    assert FIRST_TOKEN_DELAY <= result.ttft < FIRST_TOKEN_DELAY + 1.0
    assert len(result.itl) == 4 and result.generated_text == " word" * 2
    assert sum(result.itl[:2]) >= 2 * TOKEN_GAP * 0.9  # the first text came two token gaps after TTFT


def test_a_stream_of_only_a_role_chunk_has_no_token():
    async def role_only(request: httpx.Request) -> httpx.Response:
        delta = {"role": "assistant", "content": ""}
        role = sse({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        return httpx.Response(200, content=role + sse({"choices": [], "usage": None}) + b"data: [DONE]\n\n")

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(role_only)) as client:
            return await send_request(client, request_input("hello", backend="openai-chat"))

    result = asyncio.run(run())
    assert (result.success, result.failure_kind) == (False, "no_token")
    assert result.error == "the stream ended without any token chunk"


@pytest.mark.parametrize(
    ("prompt", "kind", "reason"),
    [
        ("HTTP500", "http_error", "HTTP 500: engine fell over"),
        ("TRUNCATE", "truncated", "the stream ended without data: [DONE] after 2 token chunks"),
        ("STREAMERR", "stream_error", "the server reported an error mid-stream: out of KV blocks"),
        ("SLOW", "timeout", "no complete answer within 0.3 s (--request-timeout)"),
    ],
)
def test_failures_are_classified(prompt: str, kind: str, reason: str):
    result = asyncio.run(send(FakeOpenAIServer(), request_input(prompt, timeout_s=0.3)))
    assert not result.success
    assert (result.failure_kind, result.error) == (kind, reason)


def test_connection_failure_is_a_failed_request():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await send_request(client, request_input("x"))

    result = asyncio.run(go())
    assert (result.success, result.failure_kind) == (False, "connection")
    assert "connection refused" in result.error


def test_sse_lines_join_split_data_and_skip_comments():
    lines = SSELines()
    assert lines.feed(": ping") is None
    assert lines.feed("event: message") is None
    assert lines.feed('data: {"a":') is None
    assert lines.feed("data: 1}") == {"a": 1}  # joined, and handed out decoded (parsed once)
    assert lines.feed("") is None
    assert lines.feed("data: [DONE]") == "[DONE]"
    assert lines.feed("data: not json") is None
    assert lines.feed("") == "not json"  # handed out at the blank line; StreamTimer refuses it


@pytest.mark.parametrize(("max_concurrency", "expected_peak"), [(2, 2), (None, 6)])
def test_max_concurrency_bounds_requests_in_flight(max_concurrency: int | None, expected_peak: int):
    server = FakeOpenAIServer()
    inputs = [request_input(f"prompt {index}", output_len=3) for index in range(6)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await run_requests(client, inputs, [0.0] * 6, max_concurrency)

    results, duration = asyncio.run(go())
    assert server.max_in_flight == expected_peak
    assert all(r.success for r in results)
    assert [body["prompt"] for body in server.bodies] == [f"prompt {i}" for i in range(6)]
    assert duration >= max(r.start_time + r.latency for r in results) - min(r.start_time for r in results)


def test_arrival_schedule():
    assert arrival_offsets(4, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 4
    poisson = arrival_offsets(50, 10.0, 1.0, np.random.default_rng(0))
    assert poisson == sorted(poisson) and poisson[0] > 0
    assert poisson[-1] == pytest.approx(5.0)  # scaled so the last request leaves at n / rate
    assert poisson == arrival_offsets(50, 10.0, 1.0, np.random.default_rng(0))

    def gap_spread(burstiness: float) -> float:
        offsets = arrival_offsets(2000, 10.0, burstiness, np.random.default_rng(1))
        gaps = np.diff([0.0, *offsets])
        return float(np.std(gaps) / np.mean(gaps))

    assert gap_spread(1.0) == pytest.approx(1.0, abs=0.1)  # exponential gaps: std = mean
    assert gap_spread(0.25) > 1.5 > gap_spread(1.0) > 0.5 > gap_spread(8.0)


def parse_serve_args(argv: list[str]):
    top = FlexibleArgumentParser(prog="fitserve")
    _, leaves = _add_bench_parsers(top.add_subparsers(dest="command"))
    args = leaves["serve"].parse_args(argv)
    args.command_line = "fitserve bench serve " + " ".join(argv)
    return args


def test_whole_run_saves_vllm_keys_and_counts(tmp_path):
    server = FakeOpenAIServer(send_usage=False)  # output tokens then come from the tokenizer
    args = parse_serve_args(
        ["--tokenizer", SMOLLM2_TOKENIZER, "--num-prompts", "6", "--random-input-len", "16",
         "--random-output-len", "4", "--max-concurrency", "3", "--save-result", "--save-detailed",
         "--result-dir", str(tmp_path), "--result-filename", "run.json", "--disable-tqdm",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    )  # fmt: skip
    run_serve_benchmark(args, transport=httpx.MockTransport(server))
    saved = json.loads((tmp_path / "run.json").read_text())
    assert (saved["completed"], saved["failed"], saved["failures"]) == (6, 0, {})
    assert saved["total_input_tokens"] == 6 * 16
    assert saved["total_output_tokens"] == 6 * 4  # " word" is one token with SmolLM2's tokenizer
    assert saved["server_version"] == "fake-1.0" and saved["model_id"] == "fake-model"
    assert saved["command"].startswith("fitserve bench serve --tokenizer")
    assert all(body["ignore_eos"] is True for body in server.bodies)  # random prompts always ignore eos
    assert all(t <= e2el for t, e2el in zip(saved["ttfts"], saved["latencies"], strict=True))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert saved[f"p50_{metric}_ms"] <= saved[f"p90_{metric}_ms"] <= saved[f"p99_{metric}_ms"]
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms"} <= saved.keys()
    assert saved["mean_ttft_ms"] >= FIRST_TOKEN_DELAY * 1000
    assert saved["max_concurrent_requests"] <= 3


def test_failed_requests_are_counted_not_timed(tmp_path):
    prompts = ["fine one", "HTTP500 please", "fine two", "TRUNCATE me", "fine three"]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    args = parse_serve_args(
        ["--tokenizer", SMOLLM2_TOKENIZER, "--dataset-name", "custom", "--dataset-path", str(dataset),
         "--skip-chat-template", "--custom-output-len", "3", "--num-prompts", "5", "--save-result",
         "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "mixed.json",
         "--disable-tqdm", "--percentile-metrics", "e2el"]
    )  # fmt: skip
    result = run_serve_benchmark(args, transport=httpx.MockTransport(FakeOpenAIServer()))
    assert (result["completed"], result["failed"]) == (3, 2)
    assert result["failures"] == {"http_error": 1, "truncated": 1}
    good = [lat for lat, err in zip(result["latencies"], result["errors"], strict=True) if not err]
    assert result["mean_e2el_ms"] == pytest.approx(statistics.mean(good) * 1000)
    assert result["total_output_tokens"] == 3 * 3
    saved = json.loads((tmp_path / "mixed.json").read_text())
    assert sorted(e for e in saved["errors"] if e)[0].startswith("HTTP 500")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    args = parse_serve_args(
        ["--tokenizer", SMOLLM2_TOKENIZER, "--num-prompts", "4", "--random-input-len", "8",
         "--random-output-len", "3", "--disable-tqdm", "--plot", str(tmp_path / "plot.png")]
    )  # fmt: skip
    run_serve_benchmark(args, transport=httpx.MockTransport(FakeOpenAIServer()))
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
