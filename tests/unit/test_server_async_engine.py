"""AsyncEngine: the engine thread beside the event loop, per-request queues, abort, shutdown, stats."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from fitserve.core.outputs import RequestOutput
from fitserve.core.sampling_params import SamplingParams
from fitserve.engine.async_engine import AsyncEngine, EngineUnavailableError
from fitserve.engine.stats_line import format_stats_line
from fitserve.server.streaming import EventStreamResponse
from tests.unit.oom_replay import OutOfMemoryReplayEngine
from tests.unit.server_helpers import ReplayEngine, smollm2_tokenizer

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"


def run(coroutine):
    return asyncio.run(coroutine)


def prompt_ids() -> list[int]:
    return smollm2_tokenizer().encode("Count:")


async def started(engine: ReplayEngine, observers=None) -> AsyncEngine:
    async_engine = AsyncEngine(engine, log_stats=False, observers=observers)
    await async_engine.start()
    return async_engine


def test_generate_yields_cumulative_outputs_to_the_end() -> None:
    async def scenario() -> list[RequestOutput]:
        async_engine = await started(ReplayEngine(lambda p, i: LONG, step_delay_s=0.005))
        outputs = [
            o async for o in async_engine.generate("r1", None, prompt_ids(), SamplingParams(max_tokens=50))
        ]
        await async_engine.shutdown()
        return outputs

    outputs = run(scenario())
    texts = [o.outputs[0].text for o in outputs]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    assert outputs[-1].finished and texts[-1] == LONG and outputs[-1].outputs[0].finish_reason == "stop"
    assert not any(o.finished for o in outputs[:-1])


def test_leaving_a_stream_early_aborts_the_request() -> None:
    seen: list[RequestOutput] = []

    async def scenario(engine: ReplayEngine) -> AsyncEngine:
        async_engine = await started(engine, observers=[seen.append])
        async for output in async_engine.generate("r1", None, prompt_ids(), SamplingParams(max_tokens=50)):
            if len(output.outputs[0].token_ids) >= 2:
                break
        await asyncio.sleep(0.05)  # the abort reaches the engine thread
        assert async_engine.num_in_flight == 0
        await async_engine.shutdown()
        return async_engine

    engine = ReplayEngine(lambda p, i: LONG, step_delay_s=0.01)
    run(scenario(engine))
    assert engine.aborted == ["r1"] and not engine.requests
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"


def test_cancelled_consumer_aborts_the_request() -> None:
    async def scenario(engine: ReplayEngine) -> None:
        async_engine = await started(engine)
        stream = await async_engine.add_request("r1", None, prompt_ids(), SamplingParams(max_tokens=50))
        task = asyncio.ensure_future(stream.final_output())
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        await async_engine.shutdown()

    engine = ReplayEngine(lambda p, i: LONG, step_delay_s=0.01)
    run(scenario(engine))
    assert engine.aborted == ["r1"]


def test_engine_errors_reach_the_caller() -> None:
    async def scenario() -> None:
        async_engine = await started(ReplayEngine(lambda p, i: LONG))
        with pytest.raises(ValueError, match="the prompt is empty"):
            await async_engine.add_request("r1", None, [], SamplingParams())
        stream = await async_engine.add_request("r2", None, prompt_ids(), SamplingParams(max_tokens=40))
        with pytest.raises(ValueError, match="request id 'r2' is already running"):
            await async_engine.add_request("r2", None, prompt_ids(), SamplingParams())
        await stream.final_output()
        await async_engine.shutdown()

    run(scenario())


def test_shutdown_ends_in_flight_requests_with_abort() -> None:
    async def scenario() -> None:
        async_engine = await started(ReplayEngine(lambda p, i: LONG, step_delay_s=0.01))
        streams = [
            await async_engine.add_request(f"r{i}", None, prompt_ids(), SamplingParams(n=2, max_tokens=50))
            for i in range(3)
        ]
        await asyncio.sleep(0.03)
        await async_engine.shutdown(timeout_s=5)
        finals = await asyncio.wait_for(asyncio.gather(*(s.final_output() for s in streams)), timeout=2)
        for final in finals:
            assert final.finished
            assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
        assert not async_engine.is_healthy
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await async_engine.add_request("late", None, prompt_ids(), SamplingParams())

    run(scenario())


class FailingOnceEngine(ReplayEngine):
    def __init__(self) -> None:
        super().__init__(lambda p, i: LONG)
        self.failed = False

    def step(self) -> list[RequestOutput]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("kernel exploded")
        return super().step()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on() -> None:
    async def scenario() -> None:
        async_engine = await started(FailingOnceEngine())
        stream = await async_engine.add_request("r1", None, prompt_ids(), SamplingParams(max_tokens=50))
        with pytest.raises(RuntimeError, match=r"the engine failed while generating \(RuntimeError;"):
            await stream.final_output()
        second = await async_engine.add_request("r2", None, prompt_ids(), SamplingParams(max_tokens=50))
        assert (await second.final_output()).outputs[0].text == LONG
        assert async_engine.is_healthy
        await async_engine.shutdown()

    run(scenario())


def test_an_out_of_memory_output_passes_through_and_the_others_go_on() -> None:
    # 20 ms a step: r2 is surely in flight before r1's second token sets off its failing step (with no
    # delay the engine thread could step r1 twice before the event loop added r2).
    engine = OutOfMemoryReplayEngine(
        lambda p, i: LONG, fails=lambda prompt: "Explode" in prompt, step_delay_s=0.02
    )
    seen: list[RequestOutput] = []

    async def scenario() -> tuple[RequestOutput, RequestOutput, bool]:
        async_engine = await started(engine, observers=[seen.append])
        failing = await async_engine.add_request("r1", "Explode:", None, SamplingParams(n=2, max_tokens=50))
        healthy = await async_engine.add_request("r2", None, prompt_ids(), SamplingParams(max_tokens=50))
        finals = await asyncio.gather(failing.final_output(), healthy.final_output())
        healthy_after = async_engine.is_healthy and async_engine.num_in_flight == 0
        await async_engine.shutdown()
        return finals[0], finals[1], healthy_after

    failed, completed, healthy_after = run(scenario())
    assert failed.finished and [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert failed.error is not None and failed.error.startswith("Out of GPU memory in a step of")
    assert [len(c.token_ids) for c in failed.outputs] == [2, 2]  # what it generated before the step
    assert completed.outputs[0].text == LONG and completed.outputs[0].finish_reason == "stop"
    assert healthy_after and engine.failed_steps == [(["r1"], ["r2"])]
    assert engine.aborted == []  # the engine already ended r1: nothing is aborted twice
    assert [o.error for o in seen if o.request_id == "r1" and o.finished] == [failed.error]  # observers too


def test_the_event_loop_keeps_running_during_steps() -> None:
    async def scenario() -> int:
        async_engine = await started(ReplayEngine(lambda p, i: LONG, step_delay_s=0.05))
        stream = await async_engine.add_request("r1", None, prompt_ids(), SamplingParams(max_tokens=8))
        ticks = 0
        waiter = asyncio.ensure_future(stream.final_output())
        while not waiter.done():
            await asyncio.sleep(0.005)
            ticks += 1
        await async_engine.shutdown()
        return ticks

    started_at = time.monotonic()
    ticks = run(scenario())
    elapsed = time.monotonic() - started_at
    assert elapsed >= 0.4  # 8+ steps of 50 ms ran ...
    assert ticks >= 30  # ... while the loop went on ticking every 5 ms


def test_stats_line_reads_like_vllm() -> None:
    before = SimpleNamespace(num_prompt_tokens_total=100, num_generation_tokens_total=50)
    after = SimpleNamespace(
        num_prompt_tokens_total=1100,
        num_generation_tokens_total=550,
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.125,
        prefix_cache_queries=400,
        prefix_cache_hits=100,
    )
    assert format_stats_line(before, after, 10.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 50.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )


def test_event_stream_closes_its_source_when_the_client_leaves() -> None:
    closed: list[str] = []
    sent: list[dict] = []

    async def events():
        try:
            yield "data: first\n\n"
            await asyncio.sleep(30)  # a request still waiting for its next token
            yield "data: never\n\n"
        finally:
            closed.append("closed")

    async def scenario() -> None:
        disconnect = asyncio.Event()

        async def receive() -> dict:
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message.get("body") == b"data: first\n\n":
                disconnect.set()

        response = EventStreamResponse(events(), on_close=lambda: closed.append("on_close"))
        await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=2)

    run(scenario())
    assert closed == ["closed", "on_close"]
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: first\n\n"]


def test_event_stream_runs_on_close_when_the_client_left_before_the_first_event() -> None:
    closed: list[str] = []

    async def events():
        await asyncio.sleep(30)
        yield "data: never\n\n"

    async def scenario() -> None:
        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await asyncio.sleep(30)  # the response start never gets through

        response = EventStreamResponse(events(), on_close=lambda: closed.append("on_close"))
        await asyncio.wait_for(response({"type": "http"}, receive, send), timeout=2)

    run(scenario())
    assert closed == ["on_close"]
