"""AsyncEngine's process backend (fitserve/engine/engine_process.py) on the CPU with a tiny random model:
the same outputs and errors as the engine thread, abort, a killed engine process, shutdown, startup errors.

One engine process serves most tests (its start takes a few seconds): its AsyncEngine lives on an event
loop running in a thread of the test process, and each test hands that loop its coroutine.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from fitserve import SamplingParams
from fitserve.args import EngineArgs
from fitserve.core.outputs import RequestOutput
from fitserve.engine import engine_process
from fitserve.engine.async_engine import AsyncEngine, EngineUnavailableError
from fitserve.engine.engine import Engine
from fitserve.engine.engine_process import EngineProcess, EngineProcessError
from fitserve.engine.output_deltas import OutputDecoder, OutputEncoder
from fitserve.planner.resolve import create_engine_config
from fitserve.server.api_server import use_engine_process
from fitserve.server.args import ServerSettings
from tests.unit.test_engine_vs_hf import save_tiny_model

PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77)), [200, 3, 3, 9, 250, 11, 12, 13], [7, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def tiny_args(folder: Path, **overrides: Any) -> EngineArgs:
    values: dict[str, Any] = dict(
        model=str(folder), dtype="float32", num_gpu_blocks_override=128, block_size=8, device="cpu"
    )
    return EngineArgs(**{**values, **overrides})


class LoopThread:
    """An event loop on a thread of its own; `run(coroutine)` runs one there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        self.loop.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama-process")
    save_tiny_model(folder, "LlamaForCausalLM")
    return folder


@pytest.fixture(scope="module")
def thread_engine(tiny_model: Path) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    """The reference: the same engine on the engine thread."""
    loop = LoopThread()
    engine = AsyncEngine(Engine(create_engine_config(tiny_args(tiny_model))), log_stats=False)
    loop.run(engine.start())
    yield loop, engine
    loop.run(engine.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def process_engine(tiny_model: Path) -> Iterator[tuple[LoopThread, AsyncEngine]]:
    loop = LoopThread()
    engine = AsyncEngine(EngineProcess.start(tiny_args(tiny_model)), log_stats=False)
    loop.run(engine.start())
    yield loop, engine
    loop.run(engine.shutdown())
    loop.close()


async def run_requests(engine: AsyncEngine, tag: str) -> list[tuple[RequestOutput, list[str]]]:
    """PROMPTS at once: even ones streamed (every output's text kept), odd ones awaited whole."""

    async def streamed(request_id: str, prompt: list[int]) -> tuple[RequestOutput, list[str]]:
        outputs = [o async for o in engine.generate(request_id, None, prompt, GREEDY)]
        return outputs[-1], [o.outputs[0].text for o in outputs]

    async def whole(request_id: str, prompt: list[int]) -> tuple[RequestOutput, list[str]]:
        stream = await engine.add_request(request_id, None, prompt, GREEDY)
        final = await stream.final_output()
        return final, [final.outputs[0].text]

    return await asyncio.gather(
        *((streamed if i % 2 == 0 else whole)(f"{tag}-{i}", prompt) for i, prompt in enumerate(PROMPTS))
    )


def test_greedy_outputs_match_the_engine_thread(thread_engine, process_engine) -> None:
    thread_loop, on_thread = thread_engine
    process_loop, in_process = process_engine
    expected = thread_loop.run(run_requests(on_thread, "t"))
    got = process_loop.run(run_requests(in_process, "p"))
    for (want, _), (final, texts) in zip(expected, got, strict=True):
        assert final.finished and final.prompt_token_ids == want.prompt_token_ids
        assert [(c.token_ids, c.text, c.finish_reason) for c in final.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in want.outputs
        ]
        assert len(final.outputs[0].token_ids) == GREEDY.max_tokens
        assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    assert in_process.num_in_flight == 0 and in_process.is_healthy
    stats = in_process.get_stats()
    assert stats.num_running == 0 and stats.num_generation_tokens_total >= len(PROMPTS) * GREEDY.max_tokens


def test_sampled_choices_and_logprobs_match_and_every_output_is_cumulative(
    thread_engine, process_engine
) -> None:
    # Outputs cross the pipe as deltas (new token ids and logprobs only): rebuilt, each output must be
    # whole and keep its own lists.
    params = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10, logprobs=2, ignore_eos=True)

    async def sample(engine: AsyncEngine, request_id: str) -> list[RequestOutput]:
        return [o async for o in engine.generate(request_id, None, PROMPTS[2], params)]

    thread_loop, on_thread = thread_engine
    process_loop, in_process = process_engine
    want = thread_loop.run(sample(on_thread, "n2-t"))[-1]
    outputs = process_loop.run(sample(in_process, "n2-p"))
    got = outputs[-1]

    def choices(output: RequestOutput) -> list[tuple]:
        return [(c.index, c.token_ids, c.text, c.logprobs, c.cumulative_logprob) for c in output.outputs]

    assert choices(got) == choices(want) and got.prompt_token_ids == PROMPTS[2]
    assert got.outputs[0].token_ids != got.outputs[1].token_ids
    for earlier, later in zip(outputs, outputs[1:], strict=False):
        assert earlier.prompt_token_ids == PROMPTS[2]
        for before, after in zip(earlier.outputs, later.outputs, strict=True):
            assert len(before.token_ids) == len(before.logprobs) <= len(after.token_ids)
            assert after.token_ids[: len(before.token_ids)] == before.token_ids
            assert after.logprobs[: len(before.logprobs)] == before.logprobs


@pytest.mark.parametrize(
    "prompt", [[1] * 600, [5, 100_000]], ids=["longer-than-max-model-len", "outside-the-vocabulary"]
)
def test_a_refused_request_raises_the_engines_value_error(thread_engine, process_engine, prompt) -> None:
    async def refused(engine: AsyncEngine, request_id: str) -> ValueError:
        with pytest.raises(ValueError) as raised:
            await engine.add_request(request_id, None, prompt, GREEDY)
        assert engine.num_in_flight == 0
        return raised.value

    thread_loop, on_thread = thread_engine
    process_loop, in_process = process_engine
    expected = thread_loop.run(refused(on_thread, "refused-t"))
    error = process_loop.run(refused(in_process, "refused-p"))
    assert type(error) is type(expected) and str(error) == str(expected)
    # the engine goes on
    final, _ = process_loop.run(run_requests(in_process, "after-refusal"))[0]
    assert final.finished


def test_abort_ends_the_request_in_the_engine(process_engine) -> None:
    loop, engine = process_engine
    seen: list[RequestOutput] = []

    async def scenario() -> Any:
        engine.observers.append(seen.append)
        try:
            stream = await engine.add_request("aborted", None, PROMPTS[0], LONG)
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 2:
                    break
            stream.close()  # what leaving generate() does: aborts the request
            assert engine.num_in_flight == 0
            for _ in range(200):  # the engine process takes the abort at its next command drain
                await asyncio.sleep(0.01)
                stats = engine.get_stats()
                if stats.num_running == 0 and stats.num_waiting == 0:
                    return stats
            return engine.get_stats()
        finally:
            engine.observers.remove(seen.append)

    stats = loop.run(scenario())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < LONG.max_tokens


def _engine_children() -> list[multiprocessing.process.BaseProcess]:
    return [child for child in multiprocessing.active_children() if child.name == "fitserve-engine"]


def test_a_killed_engine_process_fails_its_requests(tiny_model: Path) -> None:
    process = EngineProcess.start(tiny_args(tiny_model))

    async def scenario() -> tuple[BaseException, bool, bool]:
        engine = AsyncEngine(process, log_stats=False)
        await engine.start()
        healthy_before = engine.is_healthy
        stream = await engine.add_request("doomed", None, PROMPTS[1], LONG)
        async for output in stream:
            if output.outputs[0].token_ids:
                break
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError) as raised:
            async for _ in stream:
                pass
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("late", None, PROMPTS[0], GREEDY)
        healthy_after = engine.is_healthy
        await engine.shutdown()
        return raised.value, healthy_before, healthy_after

    error, healthy_before, healthy_after = asyncio.run(scenario())
    assert healthy_before and not healthy_after
    message = str(error)
    assert (
        "the engine stopped after an error (EngineProcessError" in message and "restart the server" in message
    )
    assert not process.is_alive() and process.process.exitcode == -signal.SIGKILL


def test_shutdown_aborts_in_flight_requests_and_ends_the_process(tiny_model: Path) -> None:
    process = EngineProcess.start(tiny_args(tiny_model))

    async def scenario() -> RequestOutput:
        engine = AsyncEngine(process, log_stats=False)
        await engine.start()
        stream = await engine.add_request("cut", None, PROMPTS[1], LONG)
        final = asyncio.ensure_future(stream.final_output())
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await engine.shutdown()
        assert time.monotonic() - started < 5
        assert not engine.is_healthy
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("too-late", None, PROMPTS[0], GREEDY)
        return await final

    final = asyncio.run(scenario())
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert process.process.exitcode == 0  # it took the stop and returned
    assert process.pid not in {child.pid for child in _engine_children()}


def test_a_startup_error_is_raised_as_the_engine_raises_it(tmp_path: Path) -> None:
    args = EngineArgs(model=str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(ValueError) as in_process:
        create_engine_config(args)
    before, started = _engine_children(), time.monotonic()
    with pytest.raises(ValueError) as from_child:
        EngineProcess.start(args)
    assert str(from_child.value).startswith(str(in_process.value))
    assert time.monotonic() - started < 60
    assert _engine_children() == before


def test_an_engine_process_killed_while_loading_is_an_error_not_a_hang(tiny_model: Path, monkeypatch) -> None:
    # the kernel's out-of-memory killer leaves no message behind: kill it once its config is resolved
    before = _engine_children()

    def kill_the_engine_process(config: Any) -> None:
        for child in _engine_children():
            if child not in before:
                os.kill(child.pid, signal.SIGKILL)
                child.join(10.0)

    monkeypatch.setattr(engine_process, "_load_tokenizer", kill_the_engine_process)
    with pytest.raises(EngineProcessError, match="was killed by signal 9 while starting"):
        EngineProcess.start(tiny_args(tiny_model))
    assert _engine_children() == before


@pytest.mark.parametrize(
    ("device", "disable", "expected"),
    [("cpu", False, False), ("cuda", False, True), ("cuda", True, False)],
)
def test_the_server_runs_the_engine_process_on_a_gpu(device: str, disable: bool, expected: bool) -> None:
    settings = ServerSettings(disable_frontend_multiprocessing=disable)
    assert use_engine_process(EngineArgs(device=device), settings) is expected


def test_outputs_cross_the_pipe_as_deltas_and_come_back_whole() -> None:
    import copy
    import pickle

    from fitserve.core.outputs import CompletionOutput, Logprob

    encoder, decoder = OutputEncoder(), OutputDecoder()
    prompt = list(range(10_000, 10_300))

    def output(request_id: str, step: int, finished: bool = False) -> RequestOutput:
        choices = [
            CompletionOutput(i, "ab" * step, [i * 1000 + t for t in range(step)], -1.0 * step, None)
            for i in range(2)
        ]
        choices[0].logprobs = [{t: Logprob(-0.5, 1)} for t in choices[0].token_ids]
        return RequestOutput(request_id, "p", prompt, choices, finished)

    sizes, whole_sizes, received = [], [], []
    for step in range(1, 6):
        sent = [output("a", step, finished=step == 5), output("b", step)]
        expected = copy.deepcopy(sent)
        whole_sizes.append(len(pickle.dumps(sent)))
        message = pickle.dumps(encoder.encode(sent))
        sizes.append(len(message))
        got = decoder.decode(pickle.loads(message))
        assert got == expected
        received.append(got)
    assert sizes[-1] < whole_sizes[-1] / 2  # the prompt went once, each token once
    assert [len(r[0].outputs[0].token_ids) for r in received] == [1, 2, 3, 4, 5]  # earlier ones untouched
    # "a" finished and "b" aborted: both sides forget them; a new request of either name starts afresh
    assert encoder.forget("b") and not encoder.forget("a")
    decoder.forget(["b"])
    assert decoder.decode(pickle.loads(pickle.dumps(encoder.encode([output("b", 1)])))) == [output("b", 1)]


def test_the_server_app_serves_from_the_engine_process(tiny_model: Path) -> None:
    from fastapi.testclient import TestClient

    from fitserve.server.app import build_app
    from tests.unit.server_helpers import sse_payloads

    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}

    def serve(engine: Any) -> tuple[dict, str]:
        app = build_app(AsyncEngine(engine, log_stats=False), ServerSettings())
        with TestClient(app) as client:
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 200, whole.text
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 200 and client.get("/health").status_code == 200
        text = "".join(p["choices"][0]["text"] for p in sse_payloads(streamed.text) if isinstance(p, dict))
        return whole.json()["choices"][0], text

    process = EngineProcess.start(tiny_args(tiny_model), decode_logprob_tokens=False)  # as `serve` does
    got, got_streamed = serve(process)
    assert not process.is_alive()  # the app's shutdown stopped it
    want, want_streamed = serve(Engine(create_engine_config(tiny_args(tiny_model))))
    assert got == want and got_streamed == want_streamed == want["text"]
    assert got["logprobs"]["top_logprobs"][0]
