"""vLLM's other `vllm serve` flags: done, accepted and logged where fitserve has no such mode, or refused
(only where ignoring them would change results or could not run)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from fitserve.args import EngineArgs, generation_overrides
from fitserve.cli.main import parse_command
from fitserve.core.outputs import CompletionOutput, RequestOutput
from fitserve.engine.async_engine import AsyncEngine
from fitserve.models.loader import load_tokenizer
from fitserve.planner.resolve import create_engine_config
from fitserve.server.api_server import h11_options
from fitserve.server.app import build_app
from fitserve.server.args import ServerSettings
from fitserve.server.request_log import log_finished_request
from tests.paths import SMOLLM2_TOKENIZER_DIR
from tests.unit.server_helpers import build_test_client, sse_payloads
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

ANSWER = "Paris is the capital."


def serve(argv: list[str]) -> tuple[EngineArgs, Any]:
    command, _, namespace = parse_command(["serve", *argv])
    assert command == "serve"
    return EngineArgs.from_cli(namespace), namespace


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-flags")
    save_tiny_model(folder, "LlamaForCausalLM")
    return folder


# ---- engine flags: accepted and logged --------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "logged"),
    [
        (["--async-scheduling"], "--async-scheduling: fitserve always schedules the next step"),
        (["--preemption-mode", "swap"], "--preemption-mode swap: fitserve preempts by recompute"),
        (["--disable-sliding-window"], "--disable-sliding-window: fitserve attends over the whole context"),
        (["--num-scheduler-steps", "8"], "--num-scheduler-steps 8: fitserve schedules every step"),
        (["--no-multi-step-stream-outputs"], "--no-multi-step-stream-outputs: fitserve streams"),
        (["--max-num-partial-prefills", "4"], "--max-num-partial-prefills 4 / --max-long-partial-prefills 1"),
        (["--max-parallel-loading-workers", "2"], "--max-parallel-loading-workers 2: fitserve loads"),
        (["--enable-sleep-mode"], "--enable-sleep-mode: fitserve has no sleep mode"),
        (["--disable-cascade-attn"], "--disable-cascade-attn: fitserve has no cascade attention"),
        (["--distributed-executor-backend", "mp"], "--distributed-executor-backend mp: fitserve runs one"),
        (["--calculate-kv-scales"], "--calculate-kv-scales: the KV cache is not fp8"),
        (["--enable-expert-parallel"], "--enable-expert-parallel: one rank holds every expert"),
        (["--max-loras", "4"], "--max-loras / --max-lora-rank / --max-cpu-loras: LoRA adapters are not"),
        (["--model-impl", "transformers"], "--model-impl transformers: fitserve runs its own implementation"),
        (
            ["--otlp-traces-endpoint", "http://c:4317"],
            "--otlp-traces-endpoint http://c:4317: fitserve exports",
        ),
    ],
)
def test_engine_flags_without_a_mode_are_accepted_and_logged(
    argv: list[str], logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    args, _ = serve(argv)
    with caplog.at_level(logging.INFO, logger="fitserve"):
        args.refuse_unsupported()
    assert logged in caplog.text
    assert "(results are unchanged)" in caplog.text


def test_defaults_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    args, _ = serve(["--preemption-mode", "recompute", "--scheduling-policy", "fcfs", "-dp", "1"])
    with caplog.at_level(logging.INFO, logger="fitserve"):
        args.refuse_unsupported()
    assert caplog.text == ""
    assert EngineArgs.from_cli(parse_command(["serve"])[2]) == EngineArgs()


def test_flags_take_vllm_spellings_and_config_keys(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("async-scheduling: true\ntokenizer-mode: slow\nhf-token: hf_abc\n", encoding="utf-8")
    args, namespace = serve(["--config", str(config), "--api-server-count", "1", "--max-log-len", "20"])
    assert (args.async_scheduling, args.tokenizer_mode, args.hf_token) == (True, "slow", "hf_abc")
    assert namespace.api_server_count == 1 and namespace.max_log_len == 20
    bare, _ = serve(["--hf-token"])
    assert bare.hf_token is True
    config.write_text("hf-token: true\n", encoding="utf-8")
    assert serve(["--config", str(config)])[0].hf_token is True


# ---- engine flags: refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--data-parallel-size", "2"],
            "--data-parallel-size 2 (set --data-parallel-size 1: data parallel runs",
        ),
        (["-dp", "4"], "--data-parallel-size 4"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral (set --tokenizer-mode auto"),
        (["--config-format", "mistral"], "--config-format mistral (set --config-format auto"),
        (["--code-revision", "abc"], "--code-revision abc (drop --code-revision"),
        (["--hf-overrides", '{"rope_theta": 1}'], "--hf-overrides (edit config.json in a local copy"),
        (["--scheduling-policy", "priority"], "--scheduling-policy priority (set --scheduling-policy fcfs"),
        (["--kv-cache-memory-bytes", "1000"], "--kv-cache-memory-bytes 1000 (size the KV cache with"),
        (
            ["--calculate-kv-scales", "--kv-cache-dtype", "fp8"],
            "--calculate-kv-scales with --kv-cache-dtype fp8 (drop --calculate-kv-scales",
        ),
        (["--logits-processor-pattern", "m.*"], "--logits-processor-pattern m.* (drop"),
    ],
)
def test_flags_that_would_change_results_are_refused(argv: list[str], message: str) -> None:
    args, _ = serve(argv)
    with pytest.raises(ValueError, match="^" + re.escape("not supported yet: " + message)):
        args.refuse_unsupported()


def test_a_refused_config_key_is_named(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("data-parallel-size: 2\n", encoding="utf-8")
    args, _ = serve(["--config", str(config)])
    with pytest.raises(ValueError, match=re.escape(f"the 'data-parallel-size' key of --config {config}")):
        args.refuse_unsupported()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(data_parallel_size=0), "data_parallel_size=0 is below the minimum 1"),
        (dict(num_scheduler_steps=0), "num_scheduler_steps=0 is below the minimum 1"),
        (dict(preemption_mode="later"), "preemption_mode='later' is not one of recompute, swap, None"),
        (dict(override_generation_config={"temprature": 0.5}), "key(s) temprature are not sampling"),
        (dict(override_generation_config="[1]"), "--override-generation-config: '[1]' is not a JSON object"),
    ],
)
def test_bad_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**kwargs).check_ranges()


def test_generation_overrides_take_generation_config_names() -> None:
    assert generation_overrides('{"temperature": 0.5, "max_new_tokens": 7}') == {
        "temperature": 0.5,
        "max_tokens": 7,
    }
    assert generation_overrides(None) == {}


# ---- engine flags: done ------------------------------------------------------------------------------


def test_tokenizer_mode_slow_asks_for_the_python_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers gives the Python tokenizer where it has one (5.x keeps few), as vLLM's slow mode."""
    import transformers

    asked: list[Any] = []
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda *args, **kwargs: asked.append(kwargs["use_fast"]),
    )
    load_tokenizer(str(SMOLLM2_TOKENIZER_DIR))
    load_tokenizer(str(SMOLLM2_TOKENIZER_DIR), use_fast=False)
    assert asked == [True, False]


def test_settings_reach_the_config(tiny_model: Path) -> None:
    args, _ = serve(
        [
            str(tiny_model),
            "--device",
            "cpu",
            "--tokenizer-mode",
            "slow",
            "--tokenizer-revision",
            "main",
            "--override-generation-config",
            '{"temperature": 0.25}',
        ]
    )
    model = create_engine_config(args, serving=True).model
    assert (model.tokenizer_mode, model.tokenizer_revision) == ("slow", "main")
    assert model.override_generation_config == {"temperature": 0.25}


def test_hf_token_is_what_the_hub_sends(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    create_engine_config(EngineArgs(model=str(tiny_model), device="cpu", hf_token="hf_secret"))
    assert os.environ["HF_TOKEN"] == "hf_secret"


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Any:
    return make_llm(
        tiny_model,
        device="cpu",
        tokenizer_mode="slow",
        override_generation_config={"temperature": 0.25, "top_k": 3},
        generation_config="vllm",
    )


def test_override_generation_config_sets_the_defaults(llm: Any) -> None:
    defaults = llm.engine.default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.25, 3)


# ---- server flags --------------------------------------------------------------------------------------


def test_prompt_tokens_details_counts_the_prefix_cache_hit(llm: Any) -> None:
    """A repeated prompt finds its full blocks in the prefix cache: usage says how many tokens."""
    from fastapi.testclient import TestClient

    app = build_app(
        AsyncEngine(llm.engine, log_stats=False), ServerSettings(enable_prompt_tokens_details=True)
    )
    prompt = list(range(40, 77))  # 37 tokens: 4 full blocks of 8
    body = {"model": str(llm.engine.config.model.model), "prompt": prompt, "max_tokens": 2}
    with TestClient(app) as client:
        first = client.post("/v1/completions", json=body).json()["usage"]
        second = client.post("/v1/completions", json=body).json()["usage"]
        streamed = client.post(
            "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens"] == 37 and second["prompt_tokens_details"] == {"cached_tokens": 32}
    assert sse_payloads(streamed.text)[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_no_prompt_tokens_details_without_the_flag() -> None:
    client, _ = build_test_client(lambda prompt, index: ANSWER)
    with client:
        reply = client.post(
            "/v1/chat/completions",
            json={"model": "replay-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        )
    assert "prompt_tokens_details" not in reply.json()["usage"]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": "Hi"}),
    ],
)
def test_force_include_usage_puts_usage_in_every_stream(route: str, body: dict) -> None:
    client, _ = build_test_client(lambda prompt, index: ANSWER, enable_force_include_usage=True)
    request = {"model": "replay-model", "max_tokens": 4, "stream": True, **body}
    with client:
        forced = sse_payloads(client.post(route, json=request).text)
    last = forced[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert all(payload.get("usage") is None for payload in forced[:-2])  # not continuous unless asked
    plain, _ = build_test_client(lambda prompt, index: ANSWER)
    with plain:
        unforced = sse_payloads(plain.post(route, json=request).text)
    assert all(payload.get("usage") is None for payload in unforced[:-1])


def make_output(prompt: str, ids: list[int]) -> RequestOutput:
    choice = CompletionOutput(0, "x", [1], None, None, finish_reason="stop")
    return RequestOutput("r1", prompt, ids, [choice], finished=True)


def test_max_log_len_shows_the_prompt_cut(caplog: pytest.LogCaptureFixture) -> None:
    output = make_output("The capital of France is", list(range(10)))
    with caplog.at_level(logging.INFO, logger="fitserve.server.request_log"):
        log_finished_request(output)
        log_finished_request(output, max_log_len=7)
        log_finished_request(output, max_log_len=100)
    plain, cut, whole = (record.getMessage() for record in caplog.records)
    assert "prompt" not in plain.split("tokens", 1)[1]
    assert cut.endswith(", prompt: 'The cap...', prompt_token_ids: [0, 1, 2, 3, 4, 5, 6, ...]")
    assert whole.endswith(
        ", prompt: 'The capital of France is', prompt_token_ids: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"
    )


def test_max_log_len_reaches_the_request_log(caplog: pytest.LogCaptureFixture) -> None:
    client, _ = build_test_client(lambda prompt, index: ANSWER, max_log_len=3)
    with caplog.at_level(logging.INFO, logger="fitserve.server.request_log"), client:
        client.post(
            "/v1/completions", json={"model": "replay-model", "prompt": [5, 6, 7, 8], "max_tokens": 2}
        )
    assert "prompt_token_ids: [5, 6, 7, ...]" in caplog.text


async def tagging_middleware(request: Any, call_next: Any) -> Any:
    response = await call_next(request)
    response.headers["X-Tagged"] = "yes"
    return response


class TaggingMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def tagged_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-class", b"yes")]
            await send(message)

        await self.app(scope, receive, tagged_send)


def test_middleware_by_import_path() -> None:
    client, _ = build_test_client(
        lambda prompt, index: ANSWER,
        middleware=[f"{__name__}.tagging_middleware", f"{__name__}:TaggingMiddleware"],
    )
    with client:
        reply = client.get("/v1/models")
    assert reply.headers["x-tagged"] == "yes" and reply.headers["x-class"] == "yes"


def test_cors_and_docs_flags() -> None:
    client, _ = build_test_client(
        lambda prompt, index: ANSWER,
        allowed_origins=["http://app.example"],
        allow_credentials=True,
        disable_fastapi_docs=True,
    )
    with client:
        preflight = client.options(
            "/v1/models",
            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "GET"},
        )
        docs = [client.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")]
    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert docs == [404, 404, 404]


def server_settings(argv: list[str]) -> ServerSettings:
    return ServerSettings.from_namespace(serve(argv)[1])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--lora-modules", "sql=/adapters/sql"],
            "not supported yet: --lora-modules sql=/adapters/sql (merge",
        ),
        (["--prompt-adapters", "p=/a"], "not supported yet: --prompt-adapters p=/a (drop --prompt-adapters)"),
        (["--enable-log-requests", "--disable-log-requests"], "--enable-log-requests and --disable-log-"),
        (["--max-log-len", "-1"], "--max-log-len -1 is below the minimum 0"),
        (["--api-server-count", "0"], "--api-server-count 0 is below the minimum 1"),
        (["--middleware", "no_such_module.mw"], "--middleware 'no_such_module.mw' cannot be imported"),
        (["--middleware", "plain"], "--middleware 'plain' is not an import path"),
    ],
)
def test_server_flags_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        server_settings(argv)


def test_server_flags_accepted(caplog: pytest.LogCaptureFixture) -> None:
    settings = server_settings(
        [
            "--api-server-count",
            "4",
            "--enable-log-requests",
            "--h11-max-incomplete-event-size",
            "65536",
            "--h11-max-header-count",
            "100",
            "--ssl-cert-reqs",
            "2",
            "--enable-prompt-tokens-details",
            "--enable-force-include-usage",
        ]
    )
    assert settings.enable_prompt_tokens_details and settings.enable_force_include_usage
    assert settings.ssl_cert_reqs == 2
    assert h11_options(settings) == {"h11_max_incomplete_event_size": 65536}
    assert h11_options(ServerSettings()) == {}
    notes = settings.accepted_no_ops()
    assert notes[0].startswith("--api-server-count 4: fitserve runs one API server process")
    assert notes[1].startswith("--h11-max-header-count 100: uvicorn bounds")
    assert ServerSettings().accepted_no_ops() == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--enable-prompt-embeds"],
            "not supported yet: --enable-prompt-embeds (send prompts as text or token",
        ),
        (["--skip-tokenizer-init"], "not supported yet: --skip-tokenizer-init (drop --skip-tokenizer-init"),
    ],
)
def test_prompt_embeds_and_no_tokenizer_are_refused(argv: list[str], message: str) -> None:
    args, _ = serve(argv)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        args.refuse_unsupported()


def test_ssl_ciphers_reach_the_server_settings() -> None:
    _, namespace = serve(["--ssl-ciphers", "ECDHE+AESGCM"])
    assert ServerSettings.from_namespace(namespace).ssl_ciphers == "ECDHE+AESGCM"
