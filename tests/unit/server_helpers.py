"""Test support for the server's unit tests: an engine that replays recorded model outputs.

`ReplayEngine` has the Engine's interface (add_request / abort_request / step / get_stats) and the
real SmolLM2 tokenizer and detokenizer; instead of running a model it emits, one token per step, the
tokens of a recorded output text chosen by the test. That drives the whole serving layer (templates,
parsers, streaming, logprobs, errors) with outputs a test controls exactly.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from transformers import AutoTokenizer

from fitserve.config import EngineConfig, ModelConfig, SchedulerConfig
from fitserve.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.detokenizer import IncrementalDetokenizer, decode_token
from tests.paths import SMOLLM2_TOKENIZER_DIR

TOKENIZER_PATH = str(SMOLLM2_TOKENIZER_DIR)
_TOKENIZER: Any = None


def smollm2_tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = AutoTokenizer.from_pretrained(TOKENIZER_PATH)
    return _TOKENIZER


def replay_config(max_model_len: int = 256, max_num_seqs: int = 8) -> EngineConfig:
    tokenizer = smollm2_tokenizer()
    hf_config = SimpleNamespace(vocab_size=len(tokenizer), architectures=["LlamaForCausalLM"])
    model = ModelConfig(
        model="replay-model",
        model_path="/recorded/replay-model",
        model_source="recorded outputs",
        tokenizer=TOKENIZER_PATH,
        hf_config=hf_config,
        dtype=None,  # type: ignore[arg-type]
        max_model_len=max_model_len,
        served_model_name=("replay-model", "replay-alias"),
    )
    return EngineConfig(
        model=model, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    )


@dataclass
class _Replay:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    scripts: list[list[int]]  # per choice: the recorded output's token ids
    detokenizers: list[IncrementalDetokenizer]
    emitted: list[list[int]]
    finish: list[str | None]
    stop_reason: list[str | int | None]
    metrics: RequestMetrics
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)


@dataclass
class ReplayStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_kv_blocks: int = 64
    block_size: int = 16


class ReplayEngine:
    """Replays `script(prompt_text, choice_index) -> output text` token by token (one per step).

    A choice ends with finish_reason "stop" when its recorded text is used up (or a stop string
    matched), "length" at max_tokens. Each token's logprob is log(1/2) with rank 1, and the top-k
    alternatives are the next token ids with log(1/4), log(1/8), ...
    """

    def __init__(
        self, script: Callable[[str, int], str], config: EngineConfig | None = None, step_delay_s: float = 0.0
    ) -> None:
        self.tokenizer = smollm2_tokenizer()
        self.step_delay_s = step_delay_s  # a model's step time: lets a stream see one token at a time
        self.config = config or replay_config()
        self.generation_defaults: dict[str, Any] = {}
        self.script = script
        self.requests: dict[str, _Replay] = {}
        self.stats = ReplayStats()
        self.added: list[str] = []
        self.aborted: list[str] = []

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = list(prompt_token_ids or self.tokenizer.encode(prompt or ""))
        if not ids:
            raise ValueError("the prompt is empty (0 tokens): send at least one token of text")
        text = prompt if prompt is not None else self.tokenizer.decode(ids)
        scripts = [
            self.tokenizer.encode(self.script(text, i), add_special_tokens=False) for i in range(params.n)
        ]
        self.requests[request_id] = _Replay(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            scripts=scripts,
            detokenizers=[IncrementalDetokenizer(self.tokenizer, ids, params) for _ in scripts],
            emitted=[[] for _ in scripts],
            finish=[None for _ in scripts],
            stop_reason=[None for _ in scripts],
            metrics=RequestMetrics(arrival_time=0.0, max_tokens_param=params.max_tokens),
            logprobs=[[] for _ in scripts],
        )
        self.added.append(request_id)
        self.stats.num_prompt_tokens_total += len(ids)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay_s)
        outputs = []
        for replay in list(self.requests.values()):
            for i, script in enumerate(replay.scripts):
                if replay.finish[i] is None:
                    self._advance(replay, i, script)
            finished = all(reason is not None for reason in replay.finish)
            outputs.append(self._output(replay, finished))
            if finished:
                del self.requests[replay.request_id]
        self.stats.num_running = len(self.requests)
        self.stats.kv_cache_usage = len(self.requests) / 64
        return outputs

    def _advance(self, replay: _Replay, i: int, script: list[int]) -> None:
        position = len(replay.emitted[i])
        if position >= len(script):
            replay.finish[i] = "stop"
            return
        token = script[position]
        replay.emitted[i].append(token)
        self.stats.num_generation_tokens_total += 1
        if replay.params.logprobs is not None:
            entries = {token: Logprob(math.log(0.5), 1, decode_token(self.tokenizer, token))}
            for k in range(replay.params.logprobs):
                alternative = (token + k + 1) % len(self.tokenizer)
                entries.setdefault(
                    alternative,
                    Logprob(math.log(0.25 / 2**k), k + 2, decode_token(self.tokenizer, alternative)),
                )
            replay.logprobs[i].append(entries)
        stop = replay.detokenizers[i].add_tokens([token])
        if stop is not None:
            replay.finish[i], replay.stop_reason[i] = "stop", stop
        elif replay.params.max_tokens is not None and len(replay.emitted[i]) >= replay.params.max_tokens:
            replay.finish[i] = "length"
        elif len(replay.emitted[i]) == len(script):
            replay.finish[i] = "stop"

    def _output(self, replay: _Replay, finished: bool) -> RequestOutput:
        choices = []
        for i, detokenizer in enumerate(replay.detokenizers):
            done = replay.finish[i] is not None
            choices.append(
                CompletionOutput(
                    index=i,
                    text=detokenizer.output_text if done else detokenizer.stream_text(False),
                    token_ids=list(replay.emitted[i]),
                    cumulative_logprob=None,
                    logprobs=list(replay.logprobs[i]) if replay.params.logprobs is not None else None,
                    finish_reason=replay.finish[i],
                    stop_reason=replay.stop_reason[i],
                )
            )
        return RequestOutput(
            request_id=replay.request_id,
            prompt=None,
            prompt_token_ids=replay.prompt_token_ids,
            outputs=choices,
            finished=finished,
            metrics=dataclasses.replace(replay.metrics),
        )

    def get_stats(self) -> ReplayStats:
        return dataclasses.replace(self.stats)


def sse_payloads(body: str) -> list[Any]:
    """The JSON payloads of a server-sent-events body, then the literal "[DONE]"."""
    import json

    payloads: list[Any] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


def build_test_client(
    script: Callable[[str, int], str],
    step_delay_s: float = 0.0,
    engine: ReplayEngine | None = None,
    **settings: Any,
) -> tuple[Any, ReplayEngine]:
    """A TestClient on the real app over a ReplayEngine (`engine`, else one replaying `script`); use it as
    a context manager (runs the lifespan)."""
    from fastapi.testclient import TestClient

    from fitserve.engine.async_engine import AsyncEngine
    from fitserve.server.app import build_app
    from fitserve.server.args import ServerSettings

    engine = engine or ReplayEngine(script, step_delay_s=step_delay_s)
    app = build_app(AsyncEngine(engine, log_stats=False), ServerSettings(**settings))
    return TestClient(app), engine
